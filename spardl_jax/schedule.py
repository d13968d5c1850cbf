"""SparDL's round schedules in pure Python (who sends which blocks to whom in each round of
Spar-Reduce-Scatter and Bruck's all-gather), and ``spardl-schedule``, which prints them."""

from spardl_jax._src.core.schedule import (BruckStep, SRSStep, bruck_schedule,
                                           cross_team_permutation, format_schedule, h_ladder,
                                           main, num_steps, recursive_doubling_permutation,
                                           srs_schedule, team_permutation)

__all__ = ['BruckStep', 'SRSStep', 'bruck_schedule', 'cross_team_permutation',
           'format_schedule', 'h_ladder', 'main', 'num_steps', 'recursive_doubling_permutation',
           'srs_schedule', 'team_permutation']

if __name__ == "__main__":
  main()
