"""Measuring: collectives and bytes read from compiled HLO (:mod:`.traffic`), the per-sync
benchmark (:mod:`.bench`) and the emulated-network benchmark (:mod:`.netbench`)."""

__all__ = ['bench', 'netbench', 'traffic']
