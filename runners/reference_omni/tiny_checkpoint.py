"""Build a tiny, seeded, randomly initialised Qwen3-Omni checkpoint from transformers' own classes.

    python -m runners.reference_omni.tiny_checkpoint OUT [--seed 0] [--eos-bias C] [--force]

OUT gets what `save_pretrained` writes (the layout vLLM-Omni 0.30.0 loads: `thinker.`, `talker.`,
`code2wav.` weights), a byte-level tokenizer with Qwen2's real ids, and `difftest-checkpoint.json`
(seed, builder version, every file's sha256). The same seed gives byte-identical files; a folder
already built with the same parameters is kept as it is.

Measured in docs/research/qwen3-omni/README.md, and why the build is what it is:
- the thinker keeps the real 152,064-token vocabulary: vLLM-Omni hard-codes the chat template's ids
  (im_start 151644, user 872, assistant 77091, system 8948) and the audio specials 151669-151675;
- the config classes' defaults are not Qwen3-Omni's (32 code groups, EOS 4198): the released
  checkpoints' codec ids and speaker map are set here;
- with transformers' default init (std 0.02 on every conv) the code2wav output is near-silent and
  barely depends on the codes: its convolutions are re-drawn with fan-in scaling;
- the random talker never emits EOS on its own; `--eos-bias C` points EOS's row of the codec head
  along a random direction of norm C, so streams stop data-dependently.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata as md
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

from difftest.family import CODEBOOK_SIZE, CODEBOOKS, QWEN3_OMNI
from difftest.suites.checkpoints import MANIFEST, hash_files

BUILDER = QWEN3_OMNI.checkpoint_builder
BUILDER_VERSION = 2  # 2: the vision fields and the processor vLLM-Omni reads at start
MANIFEST_FORMAT = "difftest.checkpoint/1"
MODEL_TYPE = QWEN3_OMNI.checkpoint_types["chat"]

HIDDEN = 64
HEAD_DIM = 32  # vLLM's CPU attention: 32 is the smallest supported head size
PATCH = 16  # the vision tower's patch, as the image and video processors must say
MROPE = {"mrope_section": [4, 6, 6], "interleaved": True, "mrope_interleaved": True, "rope_type": "default"}
THINKER_VOCAB = 152064  # the real one (above)
TALKER_VOCAB = 3072  # codec ids, specials and speakers: generate suppresses [vocab - 1024, vocab) but EOS
# The released checkpoints' talker ids (Qwen3-Omni-30B-A3B-Instruct's config.json).
CODEC_SPECIAL_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=QWEN3_OMNI.stop_id,
                         codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157)
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
# Qwen2's special tokens at their real ids, and the role words as single tokens (generate reads
# input_ids[im_start + 1] as the role).
SPECIAL_TOKENS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
    "<|vision_end|>": 151653, "<|vision_pad|>": 151654, "<|image_pad|>": 151655, "<|video_pad|>": 151656,
    "<|audio_start|>": 151669, "<|audio_end|>": 151670, "<tts_pad>": 151671, "<tts_text_bos>": 151672,
    "<tts_text_eod>": 151673, "<tts_text_bos_single>": 151674, "<|audio_pad|>": 151675}
ROLES = {"user": 872, "assistant": 77091, "system": 8948}
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for c in message['content'] %}{%- if c['type'] == 'text' %}{{- c['text'] }}"
    "{%- elif c['type'] == 'audio' %}{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif c['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif c['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def omni_config() -> dict:
    """Qwen3OmniMoeConfig's arguments: every width tiny, every id real."""
    def text(vocab: int, **more) -> dict:
        return dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=HIDDEN, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM, rope_theta=1000000,
                    rope_scaling=dict(MROPE), max_position_embeddings=65536, moe_intermediate_size=32,
                    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, **more)

    media = dict(audio_token_id=SPECIAL_TOKENS["<|audio_pad|>"], image_token_id=SPECIAL_TOKENS["<|image_pad|>"],
                 video_token_id=SPECIAL_TOKENS["<|video_pad|>"], audio_start_token_id=SPECIAL_TOKENS["<|audio_start|>"],
                 vision_start_token_id=SPECIAL_TOKENS["<|vision_start|>"], position_id_per_seconds=13,
                 seconds_per_chunk=2)
    return dict(
        thinker_config=dict(
            audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                              d_model=32, output_dim=HIDDEN, n_window=50, n_window_infer=800,
                              downsample_hidden_size=8, max_source_positions=1500, conv_chunksize=500),
            # image_size and apply_vit_abs_pos_embed: vLLM's thinker reads them (transformers does not write
            # them): 768 / PATCH = 48 = sqrt(num_position_embeddings)
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                               patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=HIDDEN,
                               num_position_embeddings=2304, deepstack_visual_indexes=[0], image_size=768,
                               apply_vit_abs_pos_embed=True),
            text_config=text(THINKER_VOCAB, decoder_sparse_step=1, shared_expert_intermediate_size=0),
            audio_end_token_id=SPECIAL_TOKENS["<|audio_end|>"], vision_end_token_id=SPECIAL_TOKENS["<|vision_end|>"],
            user_token_id=ROLES["user"], **media),
        talker_config=dict(
            text_config=text(TALKER_VOCAB, shared_expert_intermediate_size=HIDDEN),
            code_predictor_config=dict(vocab_size=CODEBOOK_SIZE, hidden_size=HIDDEN, intermediate_size=HIDDEN,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=HEAD_DIM, rope_theta=1000000, num_code_groups=CODEBOOKS,
                                       max_position_embeddings=32768),
            num_code_groups=CODEBOOKS, thinker_hidden_size=HIDDEN, accept_hidden_layer=1, speaker_id=dict(SPEAKERS),
            audio_end_token_id=SPECIAL_TOKENS["<|audio_end|>"], spatial_merge_size=2, **CODEC_SPECIAL_IDS, **media),
        code2wav_config=dict(codebook_size=CODEBOOK_SIZE, num_quantizers=CODEBOOKS, upsample_rates=[8, 5, 4, 3],
                             upsampling_ratios=[2, 2], hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                             intermediate_size=64, num_hidden_layers=1, sliding_window=72, decoder_dim=32,
                             max_position_embeddings=8000, rope_theta=10000, layer_scale_initial_scale=0.01,
                             rms_norm_eps=1e-5),
        enable_audio_output=True,
        im_start_token_id=SPECIAL_TOKENS["<|im_start|>"], im_end_token_id=SPECIAL_TOKENS["<|im_end|>"],
        tts_pad_token_id=SPECIAL_TOKENS["<tts_pad>"], tts_bos_token_id=SPECIAL_TOKENS["<tts_text_bos>"],
        tts_eos_token_id=SPECIAL_TOKENS["<tts_text_eod>"], system_token_id=ROLES["system"],
        user_token_id=ROLES["user"], assistant_token_id=ROLES["assistant"],
    )


def write_tokenizer(out: Path) -> None:
    """Byte-level BPE without merges: bytes at Qwen2's ids 0-255, the role words and specials at theirs."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers.models.qwen2.tokenization_qwen2 import bytes_to_unicode

    # Qwen2's byte symbols in its own order (printable bytes first): "Ċ" (newline) is 198, "Ġ" 220
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())} | ROLES | SPECIAL_TOKENS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(w, normalized=False, special=False) for w in ROLES])
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in SPECIAL_TOKENS])
    with _without_holes_warning():
        _save_tokenizer(tok, out)


def _save_tokenizer(tok, out: Path) -> None:
    from transformers import Qwen2TokenizerFast

    Qwen2TokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
        chat_template=CHAT_TEMPLATE, model_max_length=32768,
        extra_special_tokens={"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>",
                              "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
                              "vision_eos_token": "<|vision_end|>", "audio_bos_token": "<|audio_start|>",
                              "audio_eos_token": "<|audio_end|>"},
    ).save_pretrained(str(out), legacy_format=False)  # tokenizer.json only: the BPE pair would hold holes


@contextlib.contextmanager
def _without_holes_warning():
    """tokenizers prints every id its vocabulary lacks (150,000 of them: only the bytes, roles and
    specials are real) to stdout when it serialises one; the rest is passed on to stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines():
                if "contains holes" not in line:
                    print(line, file=sys.stderr)


def processor_config() -> dict:
    """Qwen3OmniMoeProcessor's parts as transformers 5 writes them (processor_config.json): vLLM-Omni's
    thinker builds its multimodal processor at start, text-only serving included. Written here, not by
    the classes: the image and video processors need Pillow and torchvision, which the reference's
    environment lacks."""
    vision = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "merge_size": 2, "patch_size": PATCH,
              "resample": 3, "rescale_factor": 1 / 255, "temporal_patch_size": 2}
    return {
        "processor_class": "Qwen3OmniMoeProcessor",
        "feature_extractor": {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128,
                              "sampling_rate": 16000, "hop_length": 160, "chunk_length": 300, "n_fft": 400,
                              "n_samples": 4800000, "nb_max_frames": 30000, "padding_side": "right",
                              "padding_value": 0.0, "return_attention_mask": True, "dither": 0.0},
        "image_processor": {**vision, "image_processor_type": "Qwen2VLImageProcessor",
                            "size": {"longest_edge": 12845056, "shortest_edge": 3136}},
        "video_processor": {**vision, "video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": False,
                            "max_frames": 768, "min_frames": 4, "return_metadata": False,
                            "size": {"longest_edge": 602112, "shortest_edge": 100352}},
    }


def redraw_code2wav_(code2wav, seed: int) -> None:
    """Fan-in scaled convolutions (gain 1, residual units 0.5, the last conv 0.05): audio of std ~0.1
    that follows the codes, without clipping."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)
    residual = {id(m) for unit in code2wav.decoder.modules() if type(unit).__name__.endswith("ResidualUnit")
                for m in unit.modules()}
    convs = [m for m in [*code2wav.upsample.modules(), *code2wav.decoder.modules()]
             if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
    for i, m in enumerate(convs):
        k = m.kernel_size[0]
        fan = m.in_channels * k / m.stride[0] if isinstance(m, nn.ConvTranspose1d) else m.in_channels // m.groups * k
        gain = 0.05 if i == len(convs) - 1 else 0.5 if id(m) in residual else 1.0
        with torch.no_grad():
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * gain / math.sqrt(fan))


def _build_into(out: Path, seed: int, eos_bias: float) -> None:
    import torch
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**omni_config())).eval()
    redraw_code2wav_(model.code2wav, seed + 1)
    if eos_bias:
        head = model.talker.codec_head.weight
        u = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(seed + 3))
        with torch.no_grad():
            head[QWEN3_OMNI.stop_id] = eos_bias * u / u.norm()
    model.save_pretrained(str(out))
    write_tokenizer(out)
    (out / "processor_config.json").write_text(json.dumps(processor_config(), indent=2, sort_keys=True) + "\n",
                                               encoding="utf-8")


def _parameters(seed: int, eos_bias: float) -> dict:
    return {"format": MANIFEST_FORMAT, "builder": BUILDER, "builder_version": BUILDER_VERSION, "seed": seed,
            "type": MODEL_TYPE, "family": QWEN3_OMNI.name, "eos_bias": float(eos_bias)}


def built_as(folder: Path, seed: int, eos_bias: float) -> bool:
    """True when `folder` holds an intact build with exactly these parameters."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if any(manifest.get(k) != v for k, v in _parameters(seed, eos_bias).items()):
        return False
    return manifest.get("files") == hash_files(folder)


def build(out: str | Path, seed: int = 0, eos_bias: float = 0.0, force: bool = False) -> Path:
    """Build into `out` atomically (a crash leaves no half folder); concurrent builders of one folder
    take turns under a lock file beside it."""
    out = Path(out).resolve()
    if built_as(out, seed, eos_bias):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if built_as(out, seed, eos_bias):
            return out
        if out.exists() and not force:
            raise FileExistsError(f"{out} exists and is not a Qwen3-Omni build with seed {seed}, eos bias {eos_bias}; "
                                  f"remove it or pass --force")
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
        try:
            _build_into(tmp, seed, eos_bias)
            versions = {p: md.version(p) for p in ("transformers", "torch", "tokenizers")}
            manifest = {**_parameters(seed, eos_bias), "built_with": versions, "files": hash_files(tmp)}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            for root, _, files in os.walk(tmp):  # mkdtemp is owner-only; a server may run as another user
                os.chmod(root, 0o755)
                for name in files:
                    os.chmod(os.path.join(root, name), 0o644)
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {BUILDER}", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eos-bias", type=float, default=0.0,
                    help="norm of the codec head's EOS row (0: keep it random: streams run to their token budget)")
    ap.add_argument("--force", action="store_true", help="replace an existing folder built differently")
    a = ap.parse_args(argv)
    try:
        path = build(a.out, a.seed, a.eos_bias, a.force)
    except FileExistsError as e:
        print(f"tiny_checkpoint: {e}", file=sys.stderr)
        return 2
    files = json.loads((path / MANIFEST).read_text())["files"]
    print(f"{MODEL_TYPE}: {path} ({sum((path / f).stat().st_size for f in files) / 1e6:.1f} MB, seed {a.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
