"""Problems for training and evaluation (issue 4): one `Problem` record, loaders for every format in shared/data
behind `load_problems`, grain prompt pipelines (`rstar_jax.data.pipeline`), the stage-3 difficulty filter
(`rstar_jax.data.difficulty`) and synthetic tool tasks (`rstar_jax.data.synthetic`)."""

from rstar_jax.data.problem import LoadedProblems, Problem, SkippedRows
from rstar_jax.data.registry import load_problems

__all__ = ["LoadedProblems", "Problem", "SkippedRows", "load_problems"]
