"""The converter service: published BF16 weight versions in, verified NVFP4 versions out."""
