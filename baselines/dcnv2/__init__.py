"""DCNv2 (Wang et al., WWW 2021): deep & cross network with full- or low-rank cross layers."""
