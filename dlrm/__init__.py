"""DLRM (Naumov et al., 2019): bottom MLP, pooled embeddings, dot/cat interaction, top MLP."""
