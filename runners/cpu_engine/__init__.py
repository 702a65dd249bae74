"""The difftest CPU engine: a TEST ENGINE, the negative control. It is not vLLM-Omni.

It serves the official qwen-tts package (in `.venv-reference`) over vLLM-Omni's
OpenAI-compatible speech API, with real dynamic batching and a per-request
hand-off between the talker step and the vocoder step laid out like
vLLM-Omni's. Known defects from vLLM-Omni's history can be planted with
`--defect NAME` (runners/cpu_engine/defects.py): a tester that has never caught
a planted defect proves nothing. See docs/cpu-engine.md.

    .venv-reference/bin/python -m runners.cpu_engine --model DIR [--model DIR ...] --port P
        [--host 127.0.0.1] [--defect NAME] [--max-batch 8] [--batch-window-ms 50]
        [--talker-capture full|no-input|none]

Torch-free modules (importable by the tester's own environment and its tests):
`defects`, `handoff`, `scheduler`, `api`, `server`. Only `engine` imports torch.
"""

ENGINE_NAME = "difftest-cpu-engine"
LABEL = "difftest CPU test engine (not vLLM-Omni)"
ENGINE_VERSION = 2  # 2: captures hold the talker's assembled prompt (input_prompt_embeds)
# What a capture holds of the talker's side (--talker-capture): its input and output, its output only,
# or nothing (a URL candidate's capture: codes, reference codes and audio)
TALKER_CAPTURE = ("full", "no-input", "none")


def held(mode: str, talker: dict) -> dict:
    """The part of a request's talker side (capture arrays) that `--talker-capture MODE` keeps."""
    if mode not in TALKER_CAPTURE:
        raise ValueError(f"talker capture {mode!r}: expected one of {', '.join(TALKER_CAPTURE)}")
    if mode == "none":
        return {}
    return {k: v for k, v in talker.items() if mode == "full" or not k.startswith("input_")}
