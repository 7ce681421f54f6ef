"""FinalMLP (Mao et al., AAAI 2023): two gated MLP streams fused by multi-head bilinear aggregation."""
