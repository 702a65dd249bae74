"""vLLM-Omni's offline API (`vllm_omni.Omni`) as a difftest runner: float32 audio, no HTTP.

Runs in the vLLM-Omni environment (`.venv-vllm-omni`) with difftest's capture
plugin; speaks docs/runner-protocol.md. See docs/vllm-omni.md ("The offline runner").
"""

LABEL = "vllm-omni-offline"
