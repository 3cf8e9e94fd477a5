"""Grids of RL runs (DESIGN: experiments/ sweep and ablate): gin-binding axes expanded into points (`points`, the
standard `axes`), each point run in its own process and resumed or skipped on a rerun (`runner`, `experiment`), its
held-out evaluation (`point_eval`), and the report over points: mean and spread over seeds (`aggregate`, `report`,
`plots`)."""
