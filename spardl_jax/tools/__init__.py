"""Measuring: collectives and bytes read from compiled HLO (:mod:`.traffic`), the per-sync
benchmark (:mod:`.bench`), the emulated-network benchmark (:mod:`.netbench`) and the
projection of time per sync and per step to other P and links (:mod:`.project`)."""

__all__ = ['bench', 'netbench', 'project', 'traffic']
