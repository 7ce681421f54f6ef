"""MaskNet (Wang et al., DLP-KDD 2021): instance-guided masks in serial or parallel MaskBlocks."""
