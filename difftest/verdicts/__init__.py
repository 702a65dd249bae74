"""From comparisons to verdicts: the classifier and the policy."""
