"""A decoder-only transformer language model (GPT-2, Radford et al., 2019).

The full size is GPT-2 small (12 layers, hidden 768, 12 heads, 1024 positions, the output layer
tied to the token embedding, 124.4M parameters with GPT-2's 50,257 tokens). The paper trains no
decoder-only model; this one is here because the people who most need compression train
transformers with AdamW, and a character-level one on Shakespeare trains on a CPU in minutes.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class DecoderLayer(nn.Module):
  """Pre-norm transformer layer: causal self-attention, then a GELU feed-forward."""

  hidden: int
  heads: int
  ffn: int
  dropout_rate: float

  @nn.compact
  def __call__(self, x, mask, train: bool):
    drop = nn.Dropout(self.dropout_rate, deterministic=not train)
    y = nn.MultiHeadDotProductAttention(self.heads, dropout_rate=self.dropout_rate,
                                        deterministic=not train)(nn.LayerNorm()(x), mask=mask)
    x = x + drop(y)
    y = nn.Dense(self.hidden)(nn.gelu(nn.Dense(self.ffn)(nn.LayerNorm()(x))))
    return x + drop(y)


class GPT(nn.Module):
  """``(B, L)`` int32 token ids -> ``(B, L, vocab_size)`` next-token logits."""

  vocab_size: int = 50_257
  hidden: int = 768
  layers: int = 12
  heads: int = 12
  ffn: int = 3072
  max_len: int = 1024
  dropout_rate: float = 0.1

  @nn.compact
  def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
    if tokens.shape[1] > self.max_len:
      raise ValueError(f"GPT: sequence length {tokens.shape[1]} exceeds max_len "
                       f"{self.max_len}; pass a shorter --seq-len.")
    embed = nn.Embed(self.vocab_size, self.hidden, name="token_embed")
    x = embed(tokens) + nn.Embed(self.max_len, self.hidden, name="position_embed")(
        jnp.arange(tokens.shape[1]))
    x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    # Causal alone: corpus windows are padded at the end only, so a real token never attends
    # to padding, and the targets at padded positions carry weight 0.
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.layers):
      x = DecoderLayer(self.hidden, self.heads, self.ffn, self.dropout_rate)(x, mask, train)
    return embed.attend(nn.LayerNorm()(x))
