"""SparDL's cost: the paper's Table 1 and the alpha-beta model of one sync (seconds on a
link), the team count it picks, and the wire format's bytes."""

from spardl_jax._src.core.cost import (ETHERNET_10G, INFINIBAND_100G, SparDLCost, choose_teams,
                                       modeled_seconds, sag_kind, spardl_cost, spardl_formula,
                                       spardl_paper_cost, team_counts, wire_format)

__all__ = ['ETHERNET_10G', 'INFINIBAND_100G', 'SparDLCost', 'choose_teams', 'modeled_seconds',
           'sag_kind', 'spardl_cost', 'spardl_formula', 'spardl_paper_cost', 'team_counts',
           'wire_format']
