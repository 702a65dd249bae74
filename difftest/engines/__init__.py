"""The two sides: the qwen-tts reference and the candidates, how they start, what they return."""
