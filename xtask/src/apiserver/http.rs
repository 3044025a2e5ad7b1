//! Just enough HTTP/1.1 for the fake API server: request parsing (Content-Length and chunked
//! bodies, `Expect: 100-continue`, keep-alive) and response framing (Content-Length for plain
//! responses, chunked for watches).

/// Largest request head (request line plus headers) we accept.
const MAX_HEAD: usize = 64 * 1024;
/// Largest request body we accept.
const MAX_BODY: usize = 8 * 1024 * 1024;

#[derive(Debug)]
pub(super) struct Request {
    pub method: String,
    /// The request target exactly as sent (path and query, still percent-encoded).
    pub target: String,
    /// The percent-decoded path.
    pub path: String,
    /// Decoded query pairs in the order sent.
    pub query: Vec<(String, String)>,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Whether the connection may carry another request after this one.
    pub keep_alive: bool,
}

impl Request {
    /// The first value of query parameter `key`.
    pub fn param(&self, key: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug)]
pub(super) enum Parsed {
    /// A whole request and the number of bytes it took from the buffer.
    Complete(Request, usize),
    /// More bytes are needed; `expect_continue` once the head is in and the client waits for
    /// `100 Continue` before sending its body.
    Partial { expect_continue: bool },
}

/// Why a request could not be parsed: the status code to answer with, and a message.
#[derive(Debug)]
pub(super) struct ParseError {
    pub code: u16,
    pub message: String,
}

fn bad(code: u16, message: impl Into<String>) -> ParseError {
    ParseError {
        code,
        message: message.into(),
    }
}

/// Where the head ends: the index just past the blank line, if it is in `buf`.
fn head_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < buf.len() {
        if buf[i] == b'\n' {
            if buf.get(i + 1) == Some(&b'\n') {
                return Some(i + 2);
            }
            if buf.get(i + 1) == Some(&b'\r') && buf.get(i + 2) == Some(&b'\n') {
                return Some(i + 3);
            }
        }
        i += 1;
    }
    None
}

/// Parses one request from the front of `buf`.
pub(super) fn parse(buf: &[u8]) -> Result<Parsed, ParseError> {
    // RFC 9112 §2.2: ignore empty lines before the request line.
    let mut start = 0;
    while start < buf.len() && (buf[start] == b'\r' || buf[start] == b'\n') {
        start += 1;
    }
    let rest = &buf[start..];
    let Some(end) = head_end(rest) else {
        if rest.len() > MAX_HEAD {
            return Err(bad(431, "request header fields too large"));
        }
        return Ok(Parsed::Partial {
            expect_continue: false,
        });
    };
    if end > MAX_HEAD {
        return Err(bad(431, "request header fields too large"));
    }
    let head =
        std::str::from_utf8(&rest[..end]).map_err(|_| bad(400, "request head is not UTF-8"))?;
    let mut lines = head.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad(400, format!("malformed request line {request_line:?}")));
    };
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(bad(400, format!("malformed method {method:?}")));
    }
    let http10 = match version {
        "HTTP/1.1" => false,
        "HTTP/1.0" => true,
        _ => return Err(bad(505, format!("unsupported HTTP version {version:?}"))),
    };
    if !target.starts_with('/') {
        return Err(bad(400, format!("unsupported request target {target:?}")));
    }

    let mut headers = Vec::new();
    for line in lines {
        if line.is_empty() {
            continue;
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err(bad(400, format!("malformed header line {line:?}")));
        };
        if name.is_empty() || name.bytes().any(|b| b.is_ascii_whitespace()) {
            return Err(bad(400, format!("malformed header name {name:?}")));
        }
        headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
    }
    let header = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };

    let connection = header("connection")
        .unwrap_or_default()
        .to_ascii_lowercase();
    let keep_alive = if http10 {
        connection.split(',').any(|t| t.trim() == "keep-alive")
    } else {
        !connection.split(',').any(|t| t.trim() == "close")
    };
    let expect_continue = header("expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));

    let chunked = match header("transfer-encoding") {
        None => false,
        Some(te) if te.eq_ignore_ascii_case("chunked") => true,
        Some(te) => return Err(bad(501, format!("unsupported transfer-encoding {te:?}"))),
    };
    let body_start = start + end;
    let (body, used) = if chunked {
        match decode_chunked(&buf[body_start..])? {
            Some((body, n)) => (body, body_start + n),
            None => return Ok(Parsed::Partial { expect_continue }),
        }
    } else {
        let len = match header("content-length") {
            None => 0,
            Some(v) => v
                .parse::<usize>()
                .map_err(|_| bad(400, format!("bad content-length {v:?}")))?,
        };
        if len > MAX_BODY {
            return Err(bad(413, "request body too large"));
        }
        if buf.len() < body_start + len {
            return Ok(Parsed::Partial { expect_continue });
        }
        (buf[body_start..body_start + len].to_vec(), body_start + len)
    };

    let (raw_path, raw_query) = target.split_once('?').unwrap_or((target, ""));
    let path = percent_decode(raw_path, false);
    let query = raw_query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k, true), percent_decode(v, true))
        })
        .collect();
    Ok(Parsed::Complete(
        Request {
            method: method.to_string(),
            target: target.to_string(),
            path,
            query,
            headers,
            body,
            keep_alive,
        },
        used,
    ))
}

/// Decodes a chunked body at the front of `buf`: the body and the bytes used, or None if
/// incomplete.
fn decode_chunked(buf: &[u8]) -> Result<Option<(Vec<u8>, usize)>, ParseError> {
    let mut body = Vec::new();
    let mut pos = 0;
    loop {
        let Some(nl) = buf[pos..].iter().position(|&b| b == b'\n') else {
            return Ok(None);
        };
        let line =
            std::str::from_utf8(&buf[pos..pos + nl]).map_err(|_| bad(400, "bad chunk size"))?;
        let size = line
            .trim_end_matches('\r')
            .split(';')
            .next()
            .unwrap_or_default()
            .trim();
        let size = usize::from_str_radix(size, 16)
            .map_err(|_| bad(400, format!("bad chunk size {size:?}")))?;
        pos += nl + 1;
        if size == 0 {
            // Trailers, up to an empty line.
            loop {
                let Some(nl) = buf[pos..].iter().position(|&b| b == b'\n') else {
                    return Ok(None);
                };
                let empty = nl == 0 || (nl == 1 && buf[pos] == b'\r');
                pos += nl + 1;
                if empty {
                    return Ok(Some((body, pos)));
                }
            }
        }
        if body.len() + size > MAX_BODY {
            return Err(bad(413, "request body too large"));
        }
        if buf.len() < pos + size + 1 {
            return Ok(None);
        }
        body.extend_from_slice(&buf[pos..pos + size]);
        pos += size;
        match (buf.get(pos), buf.get(pos + 1)) {
            (Some(b'\n'), _) => pos += 1,
            (Some(b'\r'), Some(b'\n')) => pos += 2,
            (Some(b'\r'), None) => return Ok(None),
            _ => return Err(bad(400, "chunk not followed by CRLF")),
        }
    }
}

/// Decodes `%XX` escapes (and `+` as space in queries); malformed escapes stay as they are.
pub(super) fn percent_decode(s: &str, plus_is_space: bool) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = |c: u8| (c as char).to_digit(16);
                match (hex(b[i + 1]), hex(b[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push((h * 16 + l) as u8);
                        i += 3;
                    }
                    _ => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(super) fn reason_phrase(code: u16) -> &'static str {
    match code {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        410 => "Gone",
        413 => "Payload Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Entity",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// A whole response with a Content-Length.
pub(super) fn response(code: u16, content_type: &str, body: &[u8], keep_alive: bool) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Cache-Control: no-cache, private\r\n{}\r\n",
        reason_phrase(code),
        body.len(),
        if keep_alive {
            ""
        } else {
            "Connection: close\r\n"
        },
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// The head of a chunked (streaming) response.
pub(super) fn chunked_head(code: u16, content_type: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n\
         Cache-Control: no-cache, private\r\n\r\n",
        reason_phrase(code)
    )
    .into_bytes()
}

/// Appends one chunk holding `data` to `out`.
pub(super) fn push_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return; // an empty chunk would end the body
    }
    out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// The last chunk, which ends a chunked body cleanly.
pub(super) const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

#[cfg(test)]
mod tests {
    use super::*;

    fn complete(buf: &[u8]) -> (Request, usize) {
        match parse(buf).unwrap() {
            Parsed::Complete(r, n) => (r, n),
            p => panic!("not complete: {p:?}"),
        }
    }

    #[test]
    fn apiserver_http_parses_pipelined_requests() {
        let buf = b"GET /api/v1/services?labelSelector=app%3Dweb%2C%21x&limit=5 HTTP/1.1\r\nHost: a\r\n\r\n\
                    POST /x HTTP/1.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
        let (r, n) = complete(buf);
        assert_eq!(r.method, "GET");
        assert_eq!(r.path, "/api/v1/services");
        assert_eq!(r.param("labelSelector"), Some("app=web,!x"));
        assert_eq!(r.param("limit"), Some("5"));
        assert!(r.keep_alive);
        let (r2, n2) = complete(&buf[n..]);
        assert_eq!(r2.body, b"{}");
        assert!(!r2.keep_alive);
        assert_eq!(n + n2, buf.len());
    }

    #[test]
    fn apiserver_http_partial_and_chunked() {
        assert!(matches!(
            parse(b"GET / HTTP/1.1\r\nHost"),
            Ok(Parsed::Partial { .. })
        ));
        let head = b"PUT /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n";
        assert!(matches!(
            parse(head),
            Ok(Parsed::Partial {
                expect_continue: true
            })
        ));
        let buf = b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n";
        let (r, n) = complete(buf);
        assert_eq!(r.body, b"abcde");
        assert_eq!(n, buf.len());
        assert!(matches!(
            parse(&buf[..buf.len() - 2]),
            Ok(Parsed::Partial { .. })
        ));
        assert!(parse(b"GET / HTTP/2.0\r\n\r\n").is_err());
        assert!(parse(b"garbage\r\n\r\n").is_err());
        assert!(parse(b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n").is_err());
    }

    #[test]
    fn apiserver_http_percent_decoding() {
        assert_eq!(percent_decode("a%2Fb+c%", true), "a/b c%");
        assert_eq!(percent_decode("a+b%zz", false), "a+b%zz");
        assert_eq!(percent_decode("%41%4", false), "A%4");
    }
}
