"""`difftest handoff`: vLLM-Omni's real talker-to-vocoder batch hand-off code, probed on CPU.

The tester side: environments (envs), generated batches with traceable marker codes (generate),
the one invariant (oracle), shrinking (shrink), the probe process client (probe), the run and its
report (run), the command (cli). Never imports torch or vllm_omni: those live in the probe process
(runners/handoff_probe), started in each release's own environment. See docs/handoff-probe.md.
"""
