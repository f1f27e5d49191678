HOPPER_CONFIGS: dict[int, MoeConfig] = {
    8: MoeConfig(16, Tiles(32, 128, 4, 4), Tiles(64, 64, 4, 5)),  # from 1 tokens
    176: MoeConfig(16, Tiles(256, 128, 4, 2), Tiles(128, 128, 4, 2)),  # from 130 tokens
    720: MoeConfig(32, Tiles(128, 128, 4, 2), Tiles(64, 128, 4, 3)),  # from 256 tokens
    2048: MoeConfig(128, Tiles(256, 64, 8, 4), Tiles(256, 64, 8, 4)),  # from 2048 tokens
}
