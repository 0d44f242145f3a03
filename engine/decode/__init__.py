"""The decoders (AR, SD, SSD), their shared frame, sampling, detokenization and the mode probe."""
