"""Attention core of wan-sage: the kernel registry, exact kernel byte formulas, eligibility,
timing, the override callable and run statistics.  Imports no ComfyUI; importing the package
itself imports nothing (not even torch), so the CLI's memory estimate runs without torch."""
