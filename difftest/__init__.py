"""difftest: does vLLM-Omni serving Qwen3-TTS at concurrency N say what qwen-tts says at concurrency 1?

This package is the tester: it orchestrates runners, compares their results and
decides. It never imports torch, qwen_tts or vllm_omni.
"""

__version__ = "0.1.0"
