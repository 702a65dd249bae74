"""difftest's capture plugin for vLLM-Omni (contract 5, docs/architecture.md).

Registered under the `vllm_omni.general_plugins` entry point (the API server and
stage workers load it) and under vLLM's `vllm.general_plugins` (the stage
engine-core processes load that one; the async-chunk hand-off runs there), so
`register()` runs in every process of the server, possibly more than once.
With `DIFFTEST_CAPTURE_DIR` set it wraps

- the talker -> code2wav hand-off (`talker2code2wav_full_payload` and
  `talker2code2wav_async_chunk`): the codes and reference codes handed to the
  vocoder, per request;
- `Qwen3TTSCode2Wav.forward`: the float32 waveform the vocoder made of them;
- the talker's scheduler (schedule.py): its prefill steps and preemptions, per request;

and writes `<dir>/<tag>.npz` for each request whose `extra_params` carried a
`difftest_tag` (or, with `DIFFTEST_CAPTURE_UNTAGGED=request-id`, for every
untagged request, as `<dir>/rid-<request id>.npz`: the offline runner's batches
cannot carry a tag per request). Signatures and return values are unchanged; a failure to
capture is logged and the request goes on. Without the variable nothing is
imported and nothing is patched.

Separately, and only when asked: `DIFFTEST_ACCEPT_LENGTH_FINISH=1` (`length_cap`) lets a voice
clone that reached its `max_new_tokens` be answered with its audio instead of HTTP 500, and
`DIFFTEST_OMNI_SUBTALKER_GREEDY=1` (`omni_greedy`) makes Qwen3-Omni's codebooks 1-15 greedy.
"""

from __future__ import annotations

import logging
import os

ENV = "DIFFTEST_CAPTURE_DIR"
TAG_KEY = "difftest_tag"
UNTAGGED_ENV = "DIFFTEST_CAPTURE_UNTAGGED"


def request_id_tag(rid: str) -> str | None:
    """The capture tag of an untagged request: `rid-` and its request id, other characters as `_`."""
    if not rid:
        return None
    return "rid-" + "".join(c if (c.isascii() and c.isalnum()) or c in "._-" else "_" for c in str(rid))[:190]

logger = logging.getLogger("vllm.difftest_capture")


def register() -> None:
    if os.environ.get("DIFFTEST_OMNI_SUBTALKER_GREEDY", "").strip() in ("1", "true", "yes"):
        try:
            from runners.vllm_omni.difftest_capture.difftest_capture.omni_greedy import install as subtalker_greedy

            subtalker_greedy()
        except Exception:
            logger.exception("difftest: DIFFTEST_OMNI_SUBTALKER_GREEDY could not be applied")
    if os.environ.get("DIFFTEST_ACCEPT_LENGTH_FINISH", "").strip() in ("1", "true", "yes"):
        try:
            from runners.vllm_omni.difftest_capture.difftest_capture.length_cap import install as accept_length_finish

            accept_length_finish()
        except Exception:
            logger.exception("difftest: DIFFTEST_ACCEPT_LENGTH_FINISH could not be applied")
    root = os.environ.get(ENV, "").strip()
    if not root:
        return
    try:
        from runners.vllm_omni.difftest_capture.difftest_capture.hooks import install

        capture = install(root)
    except Exception:  # the server must come up even when capture cannot
        logger.exception("difftest capture: not installed (the server runs without capture)")
        return
    try:
        from runners.vllm_omni.difftest_capture.difftest_capture import schedule

        wrapped = schedule.install(capture)
        if wrapped:
            logger.info("difftest capture: recording the talker's scheduling (wrapped %s)", ", ".join(wrapped))
    except Exception:
        logger.exception("difftest capture: the talker's scheduling is not recorded")
