"""The paper's two 2-layer LSTM models: a text classifier (case 5, IMDB) and a word-level
language model (case 6, PTB; the "large" model of Zaremba et al., 2014: 66M parameters)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class _StackedLSTM(nn.Module):
  hidden: int
  layers: int
  dropout_rate: float

  @nn.compact
  def __call__(self, x, seq_lengths, train: bool):
    carry = None
    for _ in range(self.layers):
      x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
      carry, x = nn.RNN(nn.OptimizedLSTMCell(self.hidden), return_carry=True)(
          x, seq_lengths=seq_lengths)
    return carry, nn.Dropout(self.dropout_rate, deterministic=not train)(x)


class LSTMClassifier(nn.Module):
  """``(B, L)`` int32 token ids (0 = padding, at the end) -> ``(B, num_classes)`` logits.

  The top layer's hidden state at each sequence's last token feeds a dense layer. The full
  size (vocabulary 40,000, embedding 512, hidden 1024) has the paper's 35.2M parameters.
  """

  vocab_size: int = 40_000
  num_classes: int = 2
  embed: int = 512
  hidden: int = 1024
  layers: int = 2
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
    lengths = jnp.maximum(jnp.sum(tokens != 0, axis=1), 1)
    x = nn.Embed(self.vocab_size, self.embed)(tokens)
    (_, h), _ = _StackedLSTM(self.hidden, self.layers, self.dropout_rate)(x, lengths, train)
    return nn.Dense(self.num_classes)(h)


class LSTMLanguageModel(nn.Module):
  """``(B, L)`` int32 token ids -> ``(B, L, vocab_size)`` next-token logits.

  Full size: Zaremba et al.'s large PTB model, vocabulary 10,000, 1500 units, dropout 0.65.
  """

  vocab_size: int = 10_000
  hidden: int = 1500
  layers: int = 2
  dropout_rate: float = 0.65

  @nn.compact
  def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
    x = nn.Embed(self.vocab_size, self.hidden)(tokens)
    _, x = _StackedLSTM(self.hidden, self.layers, self.dropout_rate)(x, None, train)
    return nn.Dense(self.vocab_size)(x)
