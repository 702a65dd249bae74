"""Build tiny, seeded, randomly initialised Qwen3-TTS 12 Hz checkpoints.

    python -m runners.reference.tiny_checkpoint OUT [--seed 0] [--type base|custom_voice|voice_design|all]
                                                    [--eos-bias C] [--listen F] [--hazard] [--force]

`--type all` (the default) writes OUT/base, OUT/custom_voice and OUT/voice_design;
a single type is written to OUT itself. Each folder loads through the official
`qwen_tts.Qwen3TTSModel.from_pretrained` untouched, and through vLLM-Omni (its
talker attention has head size 32, the smallest vLLM's CPU attention supports).
The same seed gives byte-identical files; `difftest-checkpoint.json` records the
seed, type, builder version and each file's sha256. A folder already built with
the same parameters is kept as it is.

Everything is made from qwen-tts's own classes; only the sizes are small. Two
things are deliberate rather than incidental:
- every tensor is re-drawn (codebooks, snake, layer scales, biases included) and
  the vocoder's gain is calibrated: with the default init the vocoder output
  barely depends on the codes, and a port that ignored them would still "match";
- config.json files are written by hand in the compact form the released
  checkpoints use: HF's own serialisation adds `"model_type": ""` to
  speaker_encoder_config, which Qwen3TTSSpeakerEncoderConfig cannot load.

`--hazard` (issue 58) plants the "massive activations" of trained LLMs: a few hidden channels of the
talker and of the code predictor carry HAZARD_RATIO times the median activation at every position,
and every RMSNorm over those hidden states gets weights to match (the massive channel's weight
shrunk so its normalised value stays O(1), the others' grown so the other channels keep their
calibrated scale). Without it the build is byte-identical to before; with it the manifest records
`hazard` and the caller puts it in a folder of its own. What it was for, and what it measured (it
does not make #2274 visible, and bf16 is far noisier on it than on a trained model): docs/verdicts.md,
"A checkpoint with massive activations".
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from difftest.family import CODEBOOK_SIZE, CODEBOOKS, SAMPLE_RATE, SAMPLES_PER_FRAME, STOP_ID
from runners.reference.checkpoint import MANIFEST, hash_files

BUILDER_VERSION = 1
MODEL_TYPES = ("base", "custom_voice", "voice_design")
MANIFEST_FORMAT = "difftest.checkpoint/1"
BUILDER = "runners.reference.tiny_checkpoint"
# The request's inputs (text, language, speaker, instructions) and the heads' logits are scaled by
# this: with plain unit-gain weights a wrong language or a cut text barely moves the codes, so
# teacher forcing could not see it (docs/verdicts.md, "the tiny checkpoint listens").
LISTEN = 3.0

TALKER_HIDDEN = 32
TALKER_HEAD_DIM = 32  # vLLM's CPU attention: 32 is the smallest supported head size
MROPE_SECTION = [4, 6, 6]  # sums to head_dim / 2
PREDICTOR_HIDDEN = 16  # != talker hidden, so small_to_mtp_projection is a Linear (as in the 1.7B)
TEXT_HIDDEN = 48  # != talker hidden, so text_projection really projects
SPEAKERS = {"alice": 3000, "bob": 3001}  # custom_voice speakers -> codec embedding rows

# --hazard: massive activations (Sun et al. 2024, arXiv 2402.17762: a handful of activations up to
# 10^4-10^5 x the median, constant across inputs, acting as biases; Sun, Canziani, LeCun, Zhu 2026,
# arXiv 2603.05498: ~1000 x the others in a few channels of Llama and Qwen models; Chen et al. 2026,
# arXiv 2605.15572: Qwen dense checkpoints' residual-stream maxima in the 10^2-10^3 range). Here:
# HAZARD_RATIO x the median |activation| of the model's input, in TALKER_MASSIVE of the talker's 32
# channels (signs alternate) and PREDICTOR_MASSIVE of the code predictor's 16.
HAZARD_RATIO = 1000.0
TALKER_MASSIVE = 2
PREDICTOR_MASSIVE = 1
HIDDEN_NORMS = ("input_layernorm", "post_attention_layernorm", "norm")

# The codec ids and language ids of the released checkpoints.
CODEC_SPECIAL_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=STOP_ID, codec_think_id=2154,
                         codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157)
LANGUAGE_IDS = {"chinese": 2055, "english": 2050, "german": 2053, "spanish": 2054, "japanese": 2058,
                "french": 2061, "korean": 2064, "russian": 2069, "italian": 2070, "portuguese": 2071}

# The released checkpoints' generation_config.json (qwen-tts json.loads it as its defaults).
GENERATION_DEFAULTS = {
    "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
    "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0, "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}

# Text tokenizer: 256 byte symbols, merges that make "assistant" one token (qwen-tts slices
# the prompt by position: "<|im_start|>assistant\n" must be exactly 3 tokens), and the specials.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]
SINGLE_TOKEN_WORDS = ["assistant"]


def write_text_tokenizer(out: Path):
    """A byte-level BPE Qwen2TokenizerFast; returns it (its files are written by the processor)."""
    from transformers import Qwen2TokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import bytes_to_unicode

    byte_symbol = bytes_to_unicode()
    vocab = {byte_symbol[b]: b for b in range(256)}
    merges = []
    for word in SINGLE_TOKEN_WORDS:
        merged = word[0]
        for ch in word[1:]:
            merges.append(f"{merged} {ch}")
            merged += ch
            vocab.setdefault(merged, len(vocab))
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges), encoding="utf-8")
    tok = Qwen2TokenizerFast(vocab_file=str(out / "vocab.json"), merges_file=str(out / "merges.txt"),
                             unk_token=None, bos_token=None, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0],
                             model_max_length=32768)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tok


def tts_config(tok, model_type: str) -> dict:
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    custom = model_type == "custom_voice"
    return dict(
        architectures=["Qwen3TTSForConditionalGeneration"],
        model_type="qwen3_tts",
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        # qwen-tts drops custom-voice instructions when the size is a substring of "0b6".
        tts_model_size="0b6" if model_type == "base" else "1b7",
        tts_model_type=model_type,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"],
        talker_config=dict(
            vocab_size=3072,  # 2048 codes + 1024 specials, as released: the suppressed range is real
            hidden_size=TALKER_HIDDEN,
            intermediate_size=2 * TALKER_HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=TALKER_HEAD_DIM,
            hidden_act="silu",
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_theta=1000000,
            rope_scaling={"interleaved": True, "mrope_section": MROPE_SECTION, "rope_type": "default"},
            attention_bias=False,
            num_code_groups=CODEBOOKS,
            text_hidden_size=TEXT_HIDDEN,
            text_vocab_size=(len(tok) + 31) // 32 * 32,
            position_id_per_seconds=13,
            **CODEC_SPECIAL_IDS,
            codec_language_id=LANGUAGE_IDS,
            spk_id=dict(SPEAKERS) if custom else {},
            spk_is_dialect={name: False for name in SPEAKERS} if custom else {},
            code_predictor_config=dict(
                vocab_size=CODEBOOK_SIZE, hidden_size=PREDICTOR_HIDDEN, intermediate_size=2 * PREDICTOR_HIDDEN,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                max_position_embeddings=64, rope_theta=1000000, rope_scaling=None, num_code_groups=CODEBOOKS,
                layer_types=["full_attention"],
            ),
        ),
        speaker_encoder_config=dict(
            mel_dim=128,  # extract_speaker_embedding computes 128 mels, whatever the config says
            enc_dim=TALKER_HIDDEN,  # the x-vector is spliced into the talker input
            enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
            enc_attention_channels=8, enc_res2net_scale=2, enc_se_channels=8, sample_rate=SAMPLE_RATE,
        ),
    )


def speech_tokenizer_config() -> dict:
    return dict(
        architectures=["Qwen3TTSTokenizerV2Model"],
        model_type="qwen3_tts_tokenizer_12hz",
        encoder_valid_num_quantizers=CODEBOOKS,
        input_sample_rate=SAMPLE_RATE,
        output_sample_rate=SAMPLE_RATE,
        decode_upsample_rate=SAMPLES_PER_FRAME,
        encode_downsample_rate=SAMPLES_PER_FRAME,
        encoder_config=dict(  # transformers' MimiConfig
            sampling_rate=SAMPLE_RATE, frame_rate=SAMPLE_RATE / SAMPLES_PER_FRAME, audio_channels=1, hidden_size=16,
            num_filters=4,
            num_residual_layers=1,
            upsampling_ratios=[8, 6, 5, 4],  # 960 samples a step (25 Hz), then a stride-2 downsample: 12.5 Hz
            kernel_size=7, last_kernel_size=3, residual_kernel_size=3, dilation_growth_rate=2,
            use_causal_conv=True, pad_mode="constant", compress=2, trim_right_ratio=1.0,
            codebook_size=CODEBOOK_SIZE, codebook_dim=8, num_quantizers=32, vector_quantization_hidden_dimension=8,
            num_semantic_quantizers=1,
            upsample_groups=16,  # must divide hidden_size (Mimi builds an upsampler qwen-tts drops)
            num_hidden_layers=1, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
            hidden_act="gelu", max_position_embeddings=8000, norm_eps=1e-5, use_cache=False,
            use_streaming=False, rope_theta=10000.0, sliding_window=250, attention_dropout=0.0,
            layer_scale_initial_scale=0.01, attention_bias=False,
        ),
        decoder_config=dict(
            codebook_size=CODEBOOK_SIZE, codebook_dim=16, latent_dim=16, hidden_size=16, intermediate_size=32,
            num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_hidden_layers=1,
            sliding_window=72, max_position_embeddings=8000, rope_theta=10000, rms_norm_eps=1e-5,
            hidden_act="silu", layer_scale_initial_scale=0.01, attention_bias=False, attention_dropout=0.0,
            num_quantizers=CODEBOOKS,
            upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],  # 8*5*4*3*2*2 = 1920 samples a frame
            decoder_dim=32,
        ),
    )


def randomize_(module, seed: int) -> None:
    """Re-draw every float tensor from one generator, visiting names in sorted order.

    cluster_usage stays positive (U(0.5, 1.5)); codebook sums are N(0, 1); matrices
    get unit gain (N(0, 1/fan_in)); vectors (norms, biases, scales, snake alpha/beta)
    are jittered around their initial value by N(0, 0.1).
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted(module.state_dict(keep_vars=True).items()):
            if not torch.is_floating_point(t) or name.endswith("initialized"):
                continue
            if name.endswith("cluster_usage"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif name.endswith(("embed_sum", "embedding_sum")):
                t.copy_(torch.randn(t.shape, generator=g))
            elif t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=g) / (t.numel() // t.shape[0]) ** 0.5)
            else:
                t.add_(torch.randn(t.shape, generator=g) * 0.1)


def calibrate_vocoder_gain_(speech_tokenizer, seed: int, target_std: float = 0.25) -> None:
    """Scale the vocoder's last conv so random codes give output std `target_std`.

    Unit-gain random weights drive the output into the final clamp (a +-1 square wave).
    """
    import torch

    decoder = speech_tokenizer.decoder
    last = decoder.decoder[-1]
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, decoder.config.codebook_size, (2, decoder.config.num_quantizers, 40), generator=g)
    seen = {}
    hook = last.register_forward_hook(lambda mod, inp, out: seen.setdefault("out", out))
    try:
        with torch.no_grad():
            decoder(codes)
    finally:
        hook.remove()
    scale = target_std / seen["out"].std().item()
    with torch.no_grad():
        last.conv.weight.mul_(scale)
        last.conv.bias.mul_(scale)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_it_listen_(model, factor: float) -> None:
    """Scale what carries a request's inputs into the talker by `factor` (text and instruction
    embeddings, the language and speaker rows of the codec embedding, the x-vector's projection) and
    sharpen both heads' logits by it. With unit-gain random weights the hidden state is dominated by
    the codec frames, so changing the language, the speaker or the text's end barely moves the codes
    (runners/reference/sensitivity.py measures it); here each input weighs as much as a frame.
    A speaker (one prompt row of its own) is not helped: the per-position norms undo its scale."""
    import torch

    talker = model.talker
    with torch.no_grad():
        talker.model.text_embedding.weight.mul_(factor)
        talker.model.codec_embedding.weight[sorted({*LANGUAGE_IDS.values(), *SPEAKERS.values()})] *= factor
        talker.codec_head.weight.mul_(factor)
        for head in talker.code_predictor.lm_head:
            head.weight.mul_(factor)
        encoder = getattr(model, "speaker_encoder", None)
        if encoder is not None:
            encoder.fc.weight.mul_(factor)
            if encoder.fc.bias is not None:
                encoder.fc.bias.mul_(factor)


def _norm_input_rms(decoder, inputs_embeds, position_ids, channels) -> dict:
    """Median over positions of the RMS of `channels` at the input of every RMSNorm over the hidden
    size in `decoder` (a Qwen3-style decoder: layers' input/post-attention norms and the final norm)."""
    import torch

    seen, hooks = {}, []

    def record(name, x):  # a forward hook's return value would replace the norm's output: return None
        seen.setdefault(name, x[..., channels].pow(2).mean(-1).sqrt().flatten().median().item())

    for name, mod in decoder.named_modules():
        # the norms over the hidden state (not q_norm/k_norm, over a head, whatever its width)
        if type(mod).__name__.endswith("RMSNorm") and name.rsplit(".", 1)[-1] in HIDDEN_NORMS:
            hooks.append(mod.register_forward_hook(lambda m, inp, out, name=name: record(name, inp[0])))
    try:
        with torch.no_grad():
            decoder(inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _plant_massive_(decoder, carrier_bias, inputs_embeds, position_ids, n_massive: int, ratio: float,
                    generator) -> dict:
    """Give `n_massive` hidden channels of `decoder` a constant +-ratio x median activation at every
    position (through `carrier_bias`, a bias every input row passes through) and its RMSNorms weights
    to match; returns what was planted."""
    import torch

    d = inputs_embeds.shape[-1]
    massive = sorted(torch.randperm(d, generator=generator)[:n_massive].tolist())
    others = [c for c in range(d) if c not in massive]
    median = inputs_embeds[..., others].abs().median().item()
    before = _norm_input_rms(decoder, inputs_embeds, position_ids, others)  # the calibrated scale, per norm
    value = ratio * median
    signs = [1.0 if i % 2 == 0 else -1.0 for i in range(n_massive)]
    shift = torch.zeros(d)
    with torch.no_grad():
        for c, sign in zip(massive, signs):
            carrier_bias[c] += sign * value
            shift[c] = sign * value
        # what each norm sees now: the massive channels dominate its variance
        after = _norm_input_rms(decoder, inputs_embeds + shift, position_ids, list(range(d)))
        for name, mod in decoder.named_modules():
            if name in before:
                mod.weight[others] *= after[name] / before[name]  # the other channels keep their scale
                mod.weight[massive] *= (n_massive / d) ** 0.5  # the massive ones normalise to O(1)
    return {"channels": massive, "value": round(value, 4), "median": round(median, 6)}


def plant_hazard_(model, seed: int, ratio: float = HAZARD_RATIO) -> dict:
    """--hazard: massive activations in the talker and the code predictor, norms to match."""
    import torch

    talker = model.talker
    g = torch.Generator().manual_seed(seed + 58)
    text_vocab, codec_vocab = talker.model.text_embedding.weight.shape[0], talker.model.codec_embedding.weight.shape[0]
    with torch.no_grad():
        # the talker's input rows: projected text (or the pad) plus codec embeddings, as qwen-tts sums them
        text = talker.text_projection(talker.model.text_embedding(torch.randint(0, text_vocab, (4, 64), generator=g)))
        codec = talker.model.codec_embedding(torch.randint(0, CODEBOOK_SIZE, (4, 64), generator=g))
        t_in = text + codec
        t_pos = torch.arange(64).view(1, 1, -1).expand(3, 4, -1)
        planted = {"ratio": ratio, "talker": _plant_massive_(
            talker.model, talker.text_projection.linear_fc2.bias, t_in, t_pos, TALKER_MASSIVE, ratio, g)}
        cp = talker.code_predictor
        rows = torch.cat([talker.model.codec_embedding(torch.randint(0, CODEBOOK_SIZE, (4, 1), generator=g)),
                          *[e(torch.randint(0, CODEBOOK_SIZE, (4, 1), generator=g)) for e in cp.model.codec_embedding[:CODEBOOKS - 1]]], 1)
        p_in = cp.small_to_mtp_projection(rows)
        p_pos = torch.arange(p_in.shape[1]).view(1, -1).expand(4, -1)
        planted["code_predictor"] = _plant_massive_(cp.model, cp.small_to_mtp_projection.bias, p_in, p_pos,
                                                    PREDICTOR_MASSIVE, ratio, g)
    del codec_vocab
    return planted


def _build_into(out: Path, seed: int, model_type: str, eos_bias: float, listen: float = LISTEN,
                hazard: bool = False) -> None:
    from runners.reference.environment import import_qwen_tts

    import_qwen_tts()
    import torch
    import transformers
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration, Qwen3TTSProcessor
    from transformers import EncodecFeatureExtractor

    stamp = {"transformers_version": transformers.__version__}
    tok = write_text_tokenizer(out)
    Qwen3TTSProcessor(tokenizer=tok).save_pretrained(str(out))

    torch.manual_seed(seed)
    config = tts_config(tok, model_type)
    model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**config)).eval()
    randomize_(model, seed)
    if eos_bias:
        # Random weights essentially never choose EOS (1 of 2049 allowed ids). Pointing EOS's
        # row of codec_head along a random direction makes stops data-dependent.
        u = torch.randn(model.talker.codec_head.weight.shape[1], generator=torch.Generator().manual_seed(seed + 3))
        with torch.no_grad():
            model.talker.codec_head.weight[CODEC_SPECIAL_IDS["codec_eos_token_id"]] = eos_bias * u / u.norm()
    if listen:
        make_it_listen_(model, listen)
    if hazard:
        plant_hazard_(model, seed)
    model.save_pretrained(str(out))
    _write_json(out / "config.json", {**config, **stamp})
    _write_json(out / "generation_config.json", GENERATION_DEFAULTS)

    st_dir = out / "speech_tokenizer"
    st_config = speech_tokenizer_config()
    speech_tokenizer = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**st_config)).eval()
    randomize_(speech_tokenizer, seed + 1)
    calibrate_vocoder_gain_(speech_tokenizer, seed + 2)
    speech_tokenizer.save_pretrained(str(st_dir))
    _write_json(st_dir / "config.json", {**st_config, **stamp})
    EncodecFeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE, padding_value=0.0,
                            return_attention_mask=True).save_pretrained(str(st_dir))


def _make_readable(folder: Path) -> None:
    """mkdtemp and safetensors create owner-only files; the candidate server may run as another user."""
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)


def _parameters(seed: int, model_type: str, eos_bias: float, listen: float = LISTEN, hazard: bool = False) -> dict:
    params = {"format": MANIFEST_FORMAT, "builder": BUILDER, "builder_version": BUILDER_VERSION,
              "seed": seed, "type": model_type, "eos_bias": float(eos_bias)}
    if listen:  # absent for --listen 0: that build's manifest (and so its hash) stays what it was before
        params["listen"] = float(listen)
    if hazard:  # absent without --hazard, for the same reason
        params["hazard"] = {"ratio": HAZARD_RATIO, "talker_channels": TALKER_MASSIVE,
                            "code_predictor_channels": PREDICTOR_MASSIVE}
    return params


def built_as(folder: Path, seed: int, model_type: str, eos_bias: float, listen: float = LISTEN,
             hazard: bool = False) -> bool:
    """True when `folder` holds an intact build with exactly these parameters."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    params = _parameters(seed, model_type, eos_bias, listen, hazard)
    if any(manifest.get(k) != params.get(k) for k in {*params, "listen", "hazard"}):
        return False
    return manifest.get("files") == hash_files(folder)


def build(out: str | Path, seed: int = 0, model_type: str = "base", eos_bias: float = 0.0,
          force: bool = False, listen: float = LISTEN, hazard: bool = False) -> Path:
    """Build one checkpoint into `out` (atomically: a crash leaves no half folder; concurrent
    builders of the same folder take turns under a lock file beside it)."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model type {model_type!r} (known: {', '.join(MODEL_TYPES)})")
    out = Path(out).resolve()
    if built_as(out, seed, model_type, eos_bias, listen, hazard):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Two runs starting on an empty store build the same folder: the second waits, then finds it built.
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if built_as(out, seed, model_type, eos_bias, listen, hazard):
            return out
        return _build_locked(out, seed, model_type, eos_bias, force, listen, hazard)


def _build_locked(out: Path, seed: int, model_type: str, eos_bias: float, force: bool, listen: float = LISTEN,
                  hazard: bool = False) -> Path:
    import importlib.metadata as md

    if out.exists() and not force:
        raise FileExistsError(f"{out} exists and is not a {model_type} build with seed {seed}, "
                              f"eos bias {eos_bias}; remove it or pass --force")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the gain calibration runs a forward pass: keep its float sums fixed
    try:
        _build_into(tmp, seed, model_type, eos_bias, listen, hazard)
        versions = {p: md.version(p) for p in ("qwen-tts", "transformers", "torch")}
        files = hash_files(tmp)
        _write_json(tmp / MANIFEST, {**_parameters(seed, model_type, eos_bias, listen, hazard), "built_with": versions,
                                     "files": files})
        _make_readable(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_set(out: str | Path, seed: int = 0, types=MODEL_TYPES, eos_bias: float = 0.0,
              force: bool = False, listen: float = LISTEN, hazard: bool = False) -> dict[str, Path]:
    """One checkpoint per type in OUT/<type>."""
    out = Path(out)
    return {t: build(out / t, seed, t, eos_bias, force, listen, hazard) for t in types}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runners.reference.tiny_checkpoint",
                                 description="Build tiny seeded Qwen3-TTS checkpoints for qwen-tts and vLLM-Omni.")
    ap.add_argument("out", help="output folder (with --type all: one sub-folder per type)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--type", default="all", choices=(*MODEL_TYPES, "all"))
    ap.add_argument("--eos-bias", type=float, default=0.0,
                    help="norm of codec_head's EOS row (0: keep it random; ~3 makes utterances stop early)")
    ap.add_argument("--listen", type=float, default=LISTEN,
                    help=f"scale the inputs a request carries (text, language, speaker) and the heads' logits by F "
                         f"(default {LISTEN:g}; 0: plain random weights); runners.reference.sensitivity measures it")
    ap.add_argument("--hazard", action="store_true",
                    help=f"plant massive activations ({HAZARD_RATIO:g}x the median) in the talker and the code "
                         f"predictor, norms to match: bf16's hazards of a trained model (issue 58)")
    ap.add_argument("--force", action="store_true", help="replace an existing folder built differently")
    a = ap.parse_args(argv)
    try:
        if a.type == "all":
            built = build_set(a.out, a.seed, MODEL_TYPES, a.eos_bias, a.force, a.listen, a.hazard)
        else:
            built = {a.type: build(a.out, a.seed, a.type, a.eos_bias, a.force, a.listen, a.hazard)}
    except FileExistsError as e:
        print(f"tiny_checkpoint: {e}", file=sys.stderr)
        return 2
    for mtype, path in built.items():
        manifest = json.loads((path / MANIFEST).read_text())
        print(f"{mtype}: {path} ({sum((path / f).stat().st_size for f in manifest['files']) / 1e6:.1f} MB, "
              f"seed {a.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
