"""What the transformer models share: their sizes, the check that a sequence fits, and one
layer in its two arrangements (BERT's post-norm encoder layer, GPT-2's pre-norm decoder
layer)."""

from __future__ import annotations

import flax.linen as nn
import jax


class TokenModel(nn.Module):
  """A transformer over ``(B, L)`` int32 token ids; its sizes come from ``models.MODELS``."""

  vocab_size: int
  hidden: int
  layers: int
  heads: int
  ffn: int
  max_len: int
  dropout_rate: float = 0.1

  def check_length(self, tokens: jax.Array) -> None:
    """A clear error for a sequence longer than the position embeddings."""
    if tokens.shape[1] > self.max_len:
      raise ValueError(f"{type(self).__name__}: sequence length {tokens.shape[1]} exceeds "
                       f"max_len {self.max_len}; pass a shorter --seq-len.")


class Block(nn.Module):
  """A transformer layer: self-attention, then a GELU feed-forward, each around a residual."""

  hidden: int
  heads: int
  ffn: int
  dropout_rate: float
  pre_norm: bool = False

  @nn.compact
  def __call__(self, x, mask, train: bool):
    drop = nn.Dropout(self.dropout_rate, deterministic=not train)
    attend = nn.MultiHeadDotProductAttention(self.heads, dropout_rate=self.dropout_rate,
                                             deterministic=not train)
    if self.pre_norm:  # GPT-2: each sublayer normalizes its input; tanh-approximated GELU
      x = x + drop(attend(nn.LayerNorm()(x), mask=mask))
      return x + drop(nn.Dense(self.hidden)(nn.gelu(nn.Dense(self.ffn)(nn.LayerNorm()(x)))))
    # BERT: the residual sum is normalized after each sublayer; exact GELU
    x = nn.LayerNorm(epsilon=1e-12)(x + drop(attend(x, mask=mask)))
    y = nn.Dense(self.hidden)(nn.gelu(nn.Dense(self.ffn)(x), approximate=False))
    return nn.LayerNorm(epsilon=1e-12)(x + drop(y))


class EncoderLayer(Block):
  """BERT's post-norm layer (bidirectional attention: the mask is the padding's)."""


class DecoderLayer(Block):
  """GPT-2's pre-norm layer (causal attention: the mask is the causal one)."""

  pre_norm: bool = True
