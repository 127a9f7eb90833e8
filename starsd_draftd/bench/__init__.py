"""The tooling around the draft daemon: the bench (wire, emulation, real models, batching), the analytic model and the process set the demo and tests share. The daemons never import it."""
