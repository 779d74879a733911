//! The engine's permits (PROTOCOL §6) against the reference model of
//! `ticketd_testkit::fuzz::engine_permits` (the fuzz target's body), over
//! random step sequences that proptest shrinks to the shortest failing one.

use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn permits_agree_with_the_model(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        ticketd_testkit::fuzz::engine_permits(&bytes);
    }
}
