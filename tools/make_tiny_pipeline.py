"""Write a tiny, random, fully offline diffusers pipeline of a model family (jagg_scale/models/tiny.py):

    python -m tools.make_tiny_pipeline OUT_DIR --kind sd3|flux|flux_kontext|qwenimage|flux2|zimage|wan|wan22 [--seed 0]
"""

from jagg_scale.models.tiny import main

if __name__ == "__main__":
    main()
