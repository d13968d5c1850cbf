"""Measuring what users measure: collectives and bytes read from compiled HLO
(:mod:`.traffic`), one sync of every method, timed, with its HLO bytes against its formula
(:mod:`.bench`, ``spardl-bench``), and where a measurement was taken (:mod:`.provenance`).
What only regenerates the project's published figures (the emulated network, the projection
to other P and links, the training benchmarks) lives in the repository's ``benchmarks/``, not
in the library."""

__all__ = ['bench', 'provenance', 'traffic']
