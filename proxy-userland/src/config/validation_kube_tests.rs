//! kube-proxy's configuration validation tests
//! (pkg/proxy/apis/config/validation/validation_test.go), case by case, as config files
//! through [`Args::merge_file`] and [`Args::validate`]: the same path a `--config` file
//! takes. Each case names its upstream case; upstream's addresses are mapped into
//! 198.18.0.0/15 and 2001:db8::/32 (192.168.59.0/24 is 198.18.59.0/24, 10.10.12.11 is
//! 198.18.12.11, fd00:192:168:59::/64 is 2001:db8:59::/64, 1.2.3.0/24 is 198.18.3.0/24,
//! 10.0.0.0/8 is 198.18.0.0/15); 0.0.0.0, 127.0.0.0/8 and ::1 stay what they are.
//!
//! Where we differ on purpose (each case says which):
//! - `mode`: only fastpath's modes (ebpf, iptables, userspace) are accepted; kube-proxy's
//!   ipvs and nftables are refused rather than approximated.
//! - Fields that mean nothing here are accepted and logged as ignored, whatever their value:
//!   `configSyncPeriod`, `conntrack.udpTimeout`, `conntrack.udpStreamTimeout`,
//!   `clientConnection.burst`, `ipvs`.
//! - A bind address with port 0 is accepted: the kernel picks a free port (tests rely on it).
//! - TestValidateKubeProxyIPVSConfiguration and TestValidateKubeProxyExcludeCIDRs are not
//!   ported: there is no ipvs mode.

use std::collections::BTreeMap;

use clap::{CommandFactory, FromArgMatches};

use super::*;

const BASE: &[(&str, &str)] = &[
    ("bindAddress", "198.18.59.103"),
    ("healthzBindAddress", "0.0.0.0:10256"),
    ("metricsBindAddress", "127.0.0.1:10249"),
    ("clusterCIDR", "198.18.59.0/24"),
    ("configSyncPeriod", "1s"),
    (
        "iptables",
        "{masqueradeAll: true, syncPeriod: 5s, minSyncPeriod: 2s}",
    ),
    (
        "conntrack",
        "{maxPerCore: 1, min: 1, tcpEstablishedTimeout: 5s, tcpCloseWaitTimeout: 5s}",
    ),
    ("logging", "{format: text}"),
];

/// Upstream's baseConfig with `changes` (field, YAML value) applied, merged and checked.
fn validate(changes: &[(&str, &str)]) -> Result<Args, String> {
    let mut fields: BTreeMap<&str, &str> = BASE.iter().copied().collect();
    fields.extend(changes.iter().copied());
    let yaml: String = fields.iter().map(|(k, v)| format!("{k}: {v}\n")).collect();
    let text = format!(
        "apiVersion: {}\nkind: {}\n{yaml}",
        file::API_VERSION,
        file::KIND
    );
    let matches = Args::command().try_get_matches_from(["fastpath"]).unwrap();
    let mut args = Args::from_arg_matches(&matches).unwrap();
    let cfg = KubeProxyConfiguration::parse(&text, "test.yaml").map_err(|e| e.to_string())?;
    args.merge_file(&cfg, "test.yaml", |_| false)
        .map_err(|e| e.to_string())?;
    args.validate().map_err(|e| e.to_string())?;
    Ok(args)
}

/// `None`: valid. `Some((field, words))`: refused, naming `field`, saying `words`.
type Want = Option<(&'static str, &'static str)>;

/// (upstream's case name, the fields it changes, what it expects).
type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], Want);

fn run(test: &str, cases: &[Case<'_>]) {
    for (name, changes, want) in cases {
        match (validate(changes), want) {
            (Ok(_), None) => {}
            (Err(e), Some((field, words))) => assert!(
                e.contains(&format!("{field}: ")) && e.contains(words),
                "{test}/{name}: {e}"
            ),
            (Ok(_), Some(w)) => panic!("{test}/{name}: accepted, expected {w:?}"),
            (Err(e), None) => panic!("{test}/{name}: refused: {e}"),
        }
    }
}

const MODE: Want = Some(("mode", "unknown proxy mode"));

#[test]
fn test_validate_kube_proxy_configuration() {
    run(
        "TestValidateKubeProxyConfiguration",
        &[
            ("basic config, unspecified Mode", &[], None),
            // Differs: ipvs is not one of our modes.
            (
                "Mode specified, extra mode-specific configs",
                &[
                    ("mode", "ipvs"),
                    ("ipvs", "{syncPeriod: 10s, minSyncPeriod: 5s}"),
                ],
                MODE,
            ),
            (
                "empty HealthzBindAddress",
                &[("healthzBindAddress", "\"\"")],
                None,
            ),
            (
                "IPv6",
                &[
                    ("bindAddress", "\"2001:db8:59::103\""),
                    ("healthzBindAddress", "\"\""),
                    ("metricsBindAddress", "\"[::1]:10249\""),
                    ("clusterCIDR", "\"2001:db8:59::/64\""),
                ],
                None,
            ),
            (
                "alternate healthz port",
                &[("healthzBindAddress", "0.0.0.0:12345")],
                None,
            ),
            (
                "ClusterCIDR is wrong IP family",
                &[("clusterCIDR", "\"2001:db8:168::/64\"")],
                None,
            ),
            (
                "ClusterCIDR is dual-stack",
                &[("clusterCIDR", "\"198.18.59.0/24,2001:db8:168::/64\"")],
                None,
            ),
            (
                "LocalModeInterfaceNamePrefix",
                &[
                    ("detectLocalMode", "InterfaceNamePrefix"),
                    ("detectLocal", "{interfaceNamePrefix: vethabcde}"),
                ],
                None,
            ),
            (
                "LocalModeBridgeInterface",
                &[
                    ("detectLocalMode", "BridgeInterface"),
                    ("detectLocal", "{bridgeInterface: avz}"),
                ],
                None,
            ),
            (
                "invalid BindAddress",
                &[("bindAddress", "198.18.12.11:2000")],
                Some(("bindAddress", "not an IP address")),
            ),
            (
                "invalid HealthzBindAddress",
                &[("healthzBindAddress", "0.0.0.0")],
                Some(("healthzBindAddress", "IP:PORT")),
            ),
            (
                "invalid MetricsBindAddress",
                &[("metricsBindAddress", "127.0.0.1")],
                Some(("metricsBindAddress", "IP:PORT")),
            ),
            (
                "ClusterCIDR missing subset range",
                &[("clusterCIDR", "198.18.59.0")],
                Some(("clusterCIDR", "not a CIDR")),
            ),
            (
                "Invalid number of ClusterCIDRs",
                &[(
                    "clusterCIDR",
                    "\"198.18.59.0/24,2001:db8:168::/64,198.19.0.0/16\"",
                )],
                Some(("clusterCIDR", "at most two CIDRs")),
            ),
            // Differs: configSyncPeriod (the informers' resync) is ignored, so not checked.
            (
                "ConfigSyncPeriod must be > 0",
                &[("configSyncPeriod", "-1s")],
                None,
            ),
            (
                "IPVS mode selected without providing required SyncPeriod",
                &[("mode", "ipvs")],
                MODE,
            ),
            (
                "interfacePrefix is empty",
                &[
                    ("detectLocalMode", "InterfaceNamePrefix"),
                    ("detectLocal", "{interfaceNamePrefix: \"\"}"),
                ],
                Some(("detectLocal.interfaceNamePrefix", "must not be empty")),
            ),
            (
                "bridgeInterfaceName is empty",
                &[
                    ("detectLocalMode", "BridgeInterface"),
                    ("detectLocal", "{interfaceNamePrefix: eth0}"),
                ],
                Some(("detectLocal.bridgeInterface", "must not be empty")),
            ),
            (
                "invalid DetectLocalMode",
                &[("detectLocalMode", "Guess")],
                Some(("detectLocalMode", "unknown mode")),
            ),
            (
                "invalid logging format",
                &[("logging", "{format: unsupported format}")],
                Some(("logging.format", "not a log format")),
            ),
        ],
    );
}

#[test]
fn test_validate_kube_proxy_ip_tables_configuration() {
    let ipt = |v: &'static str| -> [(&'static str, &'static str); 1] { [("iptables", v)] };
    run(
        "TestValidateKubeProxyIPTablesConfiguration",
        &[
            (
                "valid iptables config",
                &ipt("{masqueradeAll: true, syncPeriod: 5s, minSyncPeriod: 2s}"),
                None,
            ),
            (
                "valid custom MasqueradeBit",
                &ipt("{masqueradeBit: 5, masqueradeAll: true, syncPeriod: 5s, minSyncPeriod: 2s}"),
                None,
            ),
            (
                "SyncPeriod must be > 0",
                &ipt("{masqueradeAll: true, syncPeriod: -5s, minSyncPeriod: 2s}"),
                Some(("iptables.syncPeriod", "not a duration")),
            ),
            (
                "MinSyncPeriod must be > 0",
                &ipt("{masqueradeBit: 5, masqueradeAll: true, syncPeriod: 5s, minSyncPeriod: -1s}"),
                Some(("iptables.minSyncPeriod", "not a duration")),
            ),
            (
                "MasqueradeBit cannot be < 0",
                &ipt(
                    "{masqueradeBit: -10, masqueradeAll: true, syncPeriod: 5s, minSyncPeriod: 2s}",
                ),
                Some(("iptables.masqueradeBit", "0-31")),
            ),
            // Checked once the file and the flags are merged: the iptables mode's own
            // period (the others' is the top-level one or the flag).
            (
                "SyncPeriod must be >= MinSyncPeriod",
                &ipt("{masqueradeBit: 5, masqueradeAll: true, syncPeriod: 1s, minSyncPeriod: 5s}"),
                Some(("iptables.minSyncPeriod", "longer than the sync period")),
            ),
        ],
    );
}

#[test]
fn test_validate_kube_proxy_conntrack_configuration() {
    let ct = |v: &'static str| -> [(&'static str, &'static str); 1] { [("conntrack", v)] };
    run(
        "TestValidateKubeProxyConntrackConfiguration",
        &[
            (
                "valid 5 second timeouts",
                &ct(
                    "{maxPerCore: 1, min: 1, tcpEstablishedTimeout: 5s, tcpCloseWaitTimeout: 5s, udpTimeout: 5s, udpStreamTimeout: 5s}",
                ),
                None,
            ),
            (
                "valid duration equal to 0 second timeout",
                &ct(
                    "{maxPerCore: 1, min: 1, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s, udpTimeout: 0s, udpStreamTimeout: 0s}",
                ),
                None,
            ),
            (
                "invalid MaxPerCore < 0",
                &ct("{maxPerCore: -1, min: 1}"),
                Some(("conntrack.maxPerCore", "negative")),
            ),
            (
                "invalid minimum < 0",
                &ct("{maxPerCore: 1, min: -1}"),
                Some(("conntrack.min", "negative")),
            ),
            (
                "invalid TCPEstablishedTimeout < 0",
                &ct("{tcpEstablishedTimeout: -5s, tcpCloseWaitTimeout: 5s}"),
                Some(("conntrack.tcpEstablishedTimeout", "not a duration")),
            ),
            (
                "invalid TCPCloseWaitTimeout < 0",
                &ct("{tcpEstablishedTimeout: 5s, tcpCloseWaitTimeout: -5s}"),
                Some(("conntrack.tcpCloseWaitTimeout", "not a duration")),
            ),
            // Differs: the UDP conntrack timeouts are ignored (not set on the node).
            ("invalid UDPTimeout < 0", &ct("{udpTimeout: -5s}"), None),
            (
                "invalid UDPStreamTimeout < 0",
                &ct("{udpStreamTimeout: -5s}"),
                None,
            ),
        ],
    );
}

#[test]
fn test_validate_proxy_mode() {
    run(
        "TestValidateProxyMode",
        &[
            ("blank mode should default", &[("mode", "\"\"")], None),
            ("iptables is allowed", &[("mode", "iptables")], None),
            // Differs: not our modes.
            ("ipvs is allowed", &[("mode", "ipvs")], MODE),
            ("nftables is allowed", &[("mode", "nftables")], None),
            ("winkernel is not allowed", &[("mode", "kernelspace")], MODE),
            (
                "invalid mode non-existent",
                &[("mode", "non-existing")],
                MODE,
            ),
        ],
    );
    for (mode, want) in [("ebpf", Mode::Ebpf), ("userspace", Mode::Userspace)] {
        assert_eq!(validate(&[("mode", mode)]).unwrap().file_mode, Some(want));
    }
}

/// Differs: clientConnection.burst (and qps) are ignored, so any value is accepted.
#[test]
fn test_validate_client_connection_configuration() {
    run(
        "TestValidateClientConnectionConfiguration",
        &[
            (
                "successful 0 value",
                &[("clientConnection", "{burst: 0}")],
                None,
            ),
            (
                "successful 5 value",
                &[("clientConnection", "{burst: 5}")],
                None,
            ),
            ("burst < 0", &[("clientConnection", "{burst: -5}")], None),
        ],
    );
}

#[test]
fn test_validate_host_port() {
    let hz = |v: &'static str| -> [(&'static str, &'static str); 1] { [("healthzBindAddress", v)] };
    let bad = Some(("healthzBindAddress", "IP:PORT"));
    run(
        "TestValidateHostPort",
        &[
            ("all IPs", &hz("0.0.0.0:10256"), None),
            ("localhost", &hz("127.0.0.1:10256"), None),
            ("specific IP", &hz("198.18.10.10:10256"), None),
            ("missing port", &hz("198.18.10.10"), bad),
            ("digits outside of 1-255", &hz("123.456.789.10:12345"), bad),
            ("invalid named-port", &hz("198.18.10.10:foo"), bad),
            // Differs: port 0 asks the kernel for a free port.
            ("port cannot be 0", &hz("198.18.10.10:0"), None),
            (
                "port is greater than allowed range",
                &hz("198.18.10.10:65536"),
                bad,
            ),
        ],
    );
}

#[test]
fn test_validate_kube_proxy_node_port_address() {
    let not_cidr = Some(("nodePortAddresses", "not a CIDR"));
    let mix = Some(("nodePortAddresses", "can't use both 'primary' and CIDRs"));
    let npa = |v: &'static str| -> [(&'static str, &'static str); 1] { [("nodePortAddresses", v)] };
    run(
        "TestValidateKubeProxyNodePortAddress",
        &[
            ("no addresses", &npa("[]"), None),
            ("valid 1", &npa("[127.0.0.0/8]"), None),
            ("valid 2", &npa("[0.0.0.0/0]"), None),
            ("valid 3", &npa("[\"::/0\"]"), None),
            ("valid 4", &npa("[127.0.0.1/32, 198.18.3.0/24]"), None),
            ("valid 5", &npa("[127.0.0.1/32]"), None),
            ("valid 6", &npa("[\"::1/128\"]"), None),
            ("valid 7", &npa("[198.18.3.4/32]"), None),
            ("valid 8", &npa("[198.18.30.0/24]"), None),
            ("valid 9", &npa("[198.18.0.0/16, 198.19.0.0/16]"), None),
            ("valid 10", &npa("[198.18.0.0/15]"), None),
            ("valid 11", &npa("[\"2001:db8::/32\"]"), None),
            ("primary", &npa("[primary]"), None),
            ("invalid foo address", &npa("[foo]"), not_cidr),
            (
                "invalid octet address",
                &npa("[198.18.0.0/0, 198.18.3]"),
                not_cidr,
            ),
            (
                "address cannot be 0",
                &npa("[127.0.0.1/32, \"0\", 198.18.3.0/24]"),
                not_cidr,
            ),
            (
                "address missing subnet range",
                &npa("[127.0.0.1/32, 198.18.30.40, 198.18.3.0/24]"),
                not_cidr,
            ),
            (
                "missing ipv6 subnet ranges",
                &npa("[\"::0\", \"::1\", \"2001:db8::/32\"]"),
                not_cidr,
            ),
            (
                "invalid ipv6 ip format",
                &npa("[\"::1/128\", \"2001:db8::/32\", \"2001:db8:xyz/64\"]"),
                not_cidr,
            ),
            (
                "invalid primary/CIDR mix 1",
                &npa("[primary, 127.0.0.1/32]"),
                mix,
            ),
            (
                "invalid primary/CIDR mix 2",
                &npa("[127.0.0.1/32, primary]"),
                mix,
            ),
        ],
    );
    // The flag is held to the same rule.
    let e = Args::try_from_iter(["fastpath", "--nodeport-addresses", "primary,198.18.0.0/15"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--nodeport-addresses") && e.contains("'primary'"),
        "{e}"
    );
}
