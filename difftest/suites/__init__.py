"""What to synthesise: suites, voices, WAV files."""
