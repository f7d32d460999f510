"""Vision towers and projectors of vision-language families (issue 34): the encoders whose outputs take an image's
placeholder tokens' places in the language model's input embeddings."""
