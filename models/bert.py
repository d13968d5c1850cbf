"""BERT (Devlin et al., 2019) for masked-language-model pretraining (case 7).

The full size is BERT-base (12 layers, hidden 768, 12 heads, vocabulary 30,522) with the MLM
head's output layer *not* tied to the token embedding, 133.0M parameters. The paper's 133.5M
also counts the next-sentence head (pooler and classifier, 0.59M), which needs document
order that sentence-shuffled corpora (lm1b) do not have, so it is left out.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.transformer import EncoderLayer, TokenModel


class BertMLM(TokenModel):
  """``(B, L)`` int32 token ids (0 = padding) -> ``(B, L, vocab_size)`` MLM logits."""

  @nn.compact
  def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
    self.check_length(tokens)
    x = nn.Embed(self.vocab_size, self.hidden, name="token_embed")(tokens)
    x = x + nn.Embed(self.max_len, self.hidden, name="position_embed")(
        jnp.arange(tokens.shape[1]))
    # Segment embeddings of BERT (one segment here: there is no sentence-pair task).
    x = x + nn.Embed(2, self.hidden, name="segment_embed")(jnp.zeros_like(tokens))
    x = nn.Dropout(self.dropout_rate, deterministic=not train)(
        nn.LayerNorm(epsilon=1e-12)(x))
    mask = nn.make_attention_mask(tokens != 0, tokens != 0)
    for _ in range(self.layers):
      x = EncoderLayer(self.hidden, self.heads, self.ffn, self.dropout_rate)(x, mask, train)
    x = nn.LayerNorm(epsilon=1e-12)(nn.gelu(nn.Dense(self.hidden)(x), approximate=False))
    return nn.Dense(self.vocab_size, name="mlm_output")(x)
