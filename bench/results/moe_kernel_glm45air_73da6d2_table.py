    (4096, 1408): {  # 128 experts, top 8
        2: MoeConfig(16, Tiles(64, 128, 4, 3), Tiles(128, 128, 4, 3)),  # from 1 tokens
        16: MoeConfig(16, Tiles(64, 128, 4, 5), Tiles(64, 128, 4, 4)),  # from 8 tokens
        32: MoeConfig(16, Tiles(32, 256, 4, 5), Tiles(128, 128, 4, 4)),  # from 32 tokens
        80: MoeConfig(16, Tiles(64, 256, 4, 2), Tiles(32, 128, 4, 5)),  # from 64 tokens
        176: MoeConfig(16, Tiles(128, 256, 4, 2), Tiles(128, 128, 4, 2)),  # from 130 tokens
        352: MoeConfig(32, Tiles(64, 128, 4, 2), Tiles(256, 128, 4, 2)),  # from 256 tokens
        720: MoeConfig(64, Tiles(64, 64, 4, 3), Tiles(128, 64, 4, 2)),  # from 512 tokens
        2048: MoeConfig(64, Tiles(256, 64, 4, 4), Tiles(256, 64, 8, 4)),  # from 1024 tokens
        8192: MoeConfig(128, Tiles(256, 64, 8, 3), Tiles(256, 64, 8, 4)),  # from 4096 tokens
        16384: MoeConfig(128, Tiles(256, 64, 8, 4), Tiles(256, 64, 8, 4)),  # from 16384 tokens
    },
