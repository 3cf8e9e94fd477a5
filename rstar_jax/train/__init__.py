"""The learner: losses, batching, optimiser, train state, the SFT step and its checkpoints (DESIGN
"Functional learner"; SPEC sections 4-5)."""
