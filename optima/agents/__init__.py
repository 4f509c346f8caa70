"""The agents: their prompts and chat views (`prompts`), one two-agent conversation (`conversation`), many of
them against the served replicas (`generation`)."""
