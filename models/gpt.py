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

from models.transformer import DecoderLayer, TokenModel


class GPT(TokenModel):
  """``(B, L)`` int32 token ids -> ``(B, L, vocab_size)`` next-token logits."""

  @nn.compact
  def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
    self.check_length(tokens)
    embed = self.embed(self.vocab_size, "token_embed")
    x = embed(tokens) + self.embed(self.max_len, "position_embed")(jnp.arange(tokens.shape[1]))
    x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    # Causal alone: corpus windows are padded at the end only, so a real token never attends
    # to padding, and the targets at padded positions carry weight 0.
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.layers):
      x = DecoderLayer(self.hidden, self.heads, self.ffn, self.dropout_rate, bias=self.bias,
                       init=self.block_init())(x, mask, train)
    return embed.attend(nn.LayerNorm(use_bias=self.bias)(x))
