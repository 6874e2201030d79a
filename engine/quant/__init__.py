"""Weight formats: group-wise integer quantization of the large projection matrices."""
