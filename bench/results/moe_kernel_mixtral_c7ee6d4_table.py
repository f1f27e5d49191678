HOPPER_CONFIGS: dict[int, MoeConfig] = {
    2: MoeConfig(16, Tiles(64, 128, 4, 2), Tiles(64, 64, 4, 5)),  # from 1 tokens
    16: MoeConfig(16, Tiles(32, 256, 4, 5), Tiles(64, 64, 4, 3)),  # from 8 tokens
    32: MoeConfig(16, Tiles(32, 256, 4, 5), Tiles(128, 128, 4, 4)),  # from 32 tokens
    80: MoeConfig(16, Tiles(128, 256, 4, 3), Tiles(128, 64, 4, 3)),  # from 64 tokens
    176: MoeConfig(64, Tiles(32, 64, 4, 2), Tiles(128, 128, 4, 2)),  # from 130 tokens
    1024: MoeConfig(64, Tiles(32, 64, 4, 2), Tiles(64, 128, 4, 3)),  # from 512 tokens
    2048: MoeConfig(128, Tiles(256, 64, 8, 4), Tiles(256, 64, 8, 4)),  # from 2048 tokens
}
