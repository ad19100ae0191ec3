"""Integrations of lpoptim with training frameworks, one module each (``lpoptim.integrations.torchtitan``).

Nothing here is imported by ``import lpoptim``: a framework is only needed by whoever imports its module.
"""
