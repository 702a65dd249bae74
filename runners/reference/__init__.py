"""The reference runner: the official qwen-tts package at concurrency 1."""
