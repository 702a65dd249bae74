"""The comparisons: frames and chunks, codes, audio, result sets."""
