"""The hand-off probe: runs inside a vLLM-Omni environment (torch, vllm, vllm_omni importable).

It drives vLLM-Omni's own batch hand-off code, unmodified, with synthetic batches:

- the Qwen3-TTS talker's output function (``make_omni_output`` on a talker built via ``__new__``,
  as upstream's CPU tests do),
- the payload flatten and per-request split helpers (``flatten_payload``, ``build_mm_cpu``,
  ``to_payload_element``, and ``build_omni_mm_payload`` where a release has it),
- the full-payload accumulator and the talker-to-vocoder stage processors (full-payload and
  async-chunk paths).

The loop a model runner runs between those functions is the only emulated part: one small adapter
per payload layout (``adapters.py``), each naming the releases it serves and checking that the
installed release has the layout it expects.

The tester side (``difftest.handoff``) starts ``python -m runners.handoff_probe`` as a runner of
docs/runner-protocol.md; ``__main__.py`` lists its op. This package never writes files and never changes vllm_omni.
"""
