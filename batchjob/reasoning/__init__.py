"""Reasoning models' output (issue 36): the thinking text split from the answer by the family's parser."""
