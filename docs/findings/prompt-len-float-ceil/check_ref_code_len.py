"""vLLM-Omni 0.30.0: the in-context prompt's placeholder is sized with a float ceil.

Run in the vLLM-Omni environment (no model, no server): python check_ref_code_len.py
Exit 1 when a whole number of 80 ms frames is estimated one frame too many.
"""
import sys
import types

from vllm_omni.entrypoints.openai.tts_adapters.qwen3_tts import Qwen3TTSAdapter

SR, FRAME = 24000, 1920  # Qwen3-TTS-12Hz: 12.5 codec frames per second, 1920 samples each
adapter = types.SimpleNamespace(capabilities=types.SimpleNamespace(codec_frame_rate=SR / FRAME))
bad = 0
for frames in range(1, 200):
    n = frames * FRAME  # the reference encoder makes exactly `frames` frames of this
    est = Qwen3TTSAdapter._estimate_ref_code_len(adapter, ([0.0] * n, SR))
    if est != frames:
        bad += 1
        if bad <= 5:
            print(f"{n} samples ({frames} frames): the prompt reserves {est} positions")
print(f"{bad} of 199 whole-frame reference lengths are reserved a frame too many")
sys.exit(1 if bad else 0)
