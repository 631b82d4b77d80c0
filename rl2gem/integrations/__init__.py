"""Bridges from rl2gem envs to other libraries' trainers (:mod:`rl2gem.integrations.trl`)."""
