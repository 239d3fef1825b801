"""kvkern inside serving engines: connectors that put the pull path where an engine
schedules and runs requests (:mod:`kvkern.integrations.vllm`)."""
