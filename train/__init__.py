"""Data-parallel Flax trainer for spardl_jax (``python -m train``), and its public face: the
names the lab (``benchmarks/``) and a program of one's own build runs from. The modules
behind them (``train.train`` and its step functions, ``train.optimizer``, ``train.loop``,
``train.mesh``, ``train.main``'s command line) are the trainer's own."""

from train import checkpoint, data, input_pipeline, lock, report
from train.config import (NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT,
                          RECIPES, TrainConfig, Tuning, Variant, parse_variant, parse_variants,
                          recipe_tuning)
from train.mesh import make_mesh, param_specs, simulate_devices
from train.optimizer import make_optimizer, variant_tuning
from train.train import (RunResult, check_model_data, check_variant, compile_steps,
                         create_train_state, data_request, train_and_evaluate)

__all__ = ['NON_NEGATIVE_FLOAT', 'NON_NEGATIVE_INT', 'POSITIVE_FLOAT', 'POSITIVE_INT',
           'RECIPES', 'RunResult', 'TrainConfig', 'Tuning', 'Variant', 'check_model_data',
           'check_variant', 'checkpoint', 'compile_steps', 'create_train_state', 'data',
           'data_request', 'input_pipeline', 'lock', 'make_mesh', 'make_optimizer',
           'param_specs', 'parse_variant', 'parse_variants', 'recipe_tuning', 'report',
           'simulate_devices', 'train_and_evaluate', 'variant_tuning']
