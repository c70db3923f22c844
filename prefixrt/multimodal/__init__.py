"""Images for vision-language models: decoding what callers send (PIL images, bytes, local paths, data: URLs)
under limits, the model's transformers image processor, and the content hashes that key the radix cache and
the encoder-output cache."""
