"""``python -m orchestrator.agent`` = ``skyresume-agent``."""

from orchestrator.agent.main import main

main()
