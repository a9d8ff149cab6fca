"""The GPU check behind scripts/gpu-check (docs/gpu.md): steps (steps.py), their time-boxed
runner (runner.py), the report (report.py), and what travels (prepare.py, model_parts.py)."""
