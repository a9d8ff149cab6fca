"""hasten bench: time methods against Hugging Face generate on held-out code, checking outputs match.

tasks.py builds the prompts, runner.py times and checks, report.py writes results; cli.py is the command.
"""
