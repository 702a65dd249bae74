import json, os, sys, time, shutil, subprocess
import torch
torch.set_num_threads(1)
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
from transformers import Qwen3OmniMoeForConditionalGeneration

THINKER_VOCAB = int(os.environ.get("THINKER_VOCAB", "152064"))
OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/omni-research/tiny-omni"
MROPE = {"mrope_section": [4, 6, 6], "interleaved": True, "mrope_interleaved": True, "rope_type": "default"}

cfg = dict(
    thinker_config=dict(
        audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, output_dim=64, n_window=50, n_window_infer=800, downsample_hidden_size=8,
                          max_source_positions=1500, conv_chunksize=500),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=2304, deepstack_visual_indexes=[0]),
        text_config=dict(vocab_size=THINKER_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_theta=1000000,
                         rope_scaling=dict(MROPE), max_position_embeddings=65536, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         shared_expert_intermediate_size=0),
        audio_token_id=151675, image_token_id=151655, video_token_id=151656, audio_start_token_id=151669,
        audio_end_token_id=151670, vision_start_token_id=151652, vision_end_token_id=151653,
        position_id_per_seconds=13, seconds_per_chunk=2, user_token_id=872,
    ),
    talker_config=dict(
        text_config=dict(vocab_size=3072, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_theta=1000000,
                         rope_scaling=dict(MROPE), max_position_embeddings=65536, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                         shared_expert_intermediate_size=64),
        code_predictor_config=dict(vocab_size=2048, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_theta=1000000,
                                   num_code_groups=16, max_position_embeddings=32768),
        num_code_groups=16, thinker_hidden_size=64, accept_hidden_layer=1,
        codec_eos_token_id=2150, codec_bos_id=2149, codec_pad_id=2148,
        codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
        speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        audio_token_id=151675, image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        audio_start_token_id=151669, audio_end_token_id=151670, position_id_per_seconds=13,
        seconds_per_chunk=2, spatial_merge_size=2,
    ),
    code2wav_config=dict(codebook_size=2048, num_quantizers=16, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
                         hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                         num_hidden_layers=1, sliding_window=72, decoder_dim=32, max_position_embeddings=8000,
                         rope_theta=10000, layer_scale_initial_scale=0.01, rms_norm_eps=1e-5),
    enable_audio_output=True,
    im_start_token_id=151644, im_end_token_id=151645, tts_pad_token_id=151671, tts_bos_token_id=151672,
    tts_eos_token_id=151673, system_token_id=8948, user_token_id=872, assistant_token_id=77091,
)

t0 = time.time()
torch.manual_seed(0)
config = Qwen3OmniMoeConfig(**cfg)
model = Qwen3OmniMoeForConditionalGeneration(config).eval()
t_build = time.time() - t0

# Default HF init (normal std=0.02 on every conv) makes code2wav output ~1e-8 (silence).
# Re-draw code2wav conv weights with fan-in scaling so the waveform has std ~0.1, no clipping.
import math
from torch import nn
def rescale_code2wav(c2w, gain=1.0, res_gain=0.5, last_gain=0.05, seed=1234):
    g = torch.Generator().manual_seed(seed)
    res_ids = {id(x) for ru in c2w.decoder.modules() if type(ru).__name__.endswith("ResidualUnit") for x in ru.modules()}
    convs = [m for m in list(c2w.upsample.modules()) + list(c2w.decoder.modules()) if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
    for i, m in enumerate(convs):
        k = m.kernel_size[0]
        fan = m.in_channels * k / m.stride[0] if isinstance(m, nn.ConvTranspose1d) else m.in_channels // m.groups * k
        std = (last_gain if i == len(convs) - 1 else (res_gain if id(m) in res_ids else gain)) / math.sqrt(fan)
        with torch.no_grad():
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
if os.environ.get("RESCALE_C2W", "1") == "1":
    rescale_code2wav(model.code2wav)
    print("code2wav convs rescaled")

def n(m): return sum(p.numel() for p in m.parameters())
print("build_s", round(t_build, 2))
print("params_total", n(model))
for name in ["thinker.model.embed_tokens", "thinker.lm_head", "thinker.model.layers", "thinker.audio_tower", "thinker.visual",
             "talker.model", "talker.codec_head", "talker.code_predictor", "talker.text_projection", "talker.hidden_projection",
             "code2wav", "code2wav.code_embedding"]:
    print(" ", name, n(model.get_submodule(name)))
print("total_upsample", model.code2wav.total_upsample)
t1 = time.time()
if os.path.exists(OUT): shutil.rmtree(OUT)
model.save_pretrained(OUT)
print("save_s", round(time.time() - t1, 2))
print(subprocess.run(["du", "-sb", OUT], capture_output=True, text=True).stdout.strip())
print(subprocess.run(["ls", "-la", OUT], capture_output=True, text=True).stdout)
json.dump(cfg, open("/tmp/omni-research/tiny_config.json", "w"), indent=1)
# checksum of first weights for determinism check
sd = model.state_dict()
print("checksum", float(sum(v.float().sum() for v in sd.values())))
