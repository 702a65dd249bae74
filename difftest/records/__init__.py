"""What a run leaves: report.json, MLflow, the gate's decision, media."""
