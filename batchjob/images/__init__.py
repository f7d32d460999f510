"""Images in (issue 34): reading a row's images from where it names them (sources.py) and turning them into a
vision tower's pixel values as the model's processor does (clip.py: resize, crop, rescale, normalise)."""
