//! One HTTP/1.1 connection to one etcd endpoint: a JSON request out, a bounded JSON answer (or
//! the body of a streamed one) back. It knows nothing of etcd's calls.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::error::EtcdError;
use crate::user::EtcdUser;
use crate::wire::{AuthenticateRequest, AuthenticateResponse, GatewayError, StreamItem};

/// The most bytes read of one answer: a whole directory's range stays far below it (a record is
/// at most 64 KiB and etcd's own requests 1.5 MiB), and a peer that sends more is not etcd.
pub const MAX_ANSWER: usize = 64 << 20;

/// The most bytes one message of a watch may take.
pub const MAX_WATCH_MESSAGE: usize = 64 << 20;

/// An etcd client URL, `http://HOST:PORT` or `https://HOST:PORT`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    url: String,
    authority: String,
    scheme: Scheme,
}

/// How an endpoint is spoken to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheme {
    /// HTTP in clear.
    Http,
    /// HTTP over TLS: etcd's certificate checked against the caller's CA, the caller's own
    /// presented (etcd's `--client-cert-auth`).
    Https,
}

impl Endpoint {
    pub(crate) fn parse(url: &str) -> Result<Endpoint, EtcdError> {
        let bad = || EtcdError::Endpoint(url.to_string());
        let (scheme, authority) = match url.strip_prefix("https://") {
            Some(rest) => (Scheme::Https, rest),
            None => (Scheme::Http, url.strip_prefix("http://").ok_or_else(bad)?),
        };
        let authority = authority.strip_suffix('/').unwrap_or(authority);
        let (host, port) = authority.rsplit_once(':').ok_or_else(bad)?;
        let port_ok = port.parse::<u16>().is_ok_and(|p| p != 0);
        if host.is_empty() || !port_ok || authority.contains(['/', '@', '?', '#', ' ']) {
            return Err(bad());
        }
        Ok(Endpoint {
            url: url.to_string(),
            authority: authority.to_string(),
            scheme,
        })
    }

    /// The host, as a TLS server name: a DNS name or an IP address (without its brackets).
    fn server_name(&self) -> Result<rustls_pki_types::ServerName<'static>, EtcdError> {
        let host = self
            .authority
            .rsplit_once(':')
            .map_or(self.authority.as_str(), |(host, _)| host);
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        rustls_pki_types::ServerName::try_from(host.to_string())
            .map_err(|_| EtcdError::Endpoint(self.url.clone()))
    }

    /// Whether the host is this machine's loopback (`localhost`, 127.0.0.0/8, `::1`).
    fn is_loopback(&self) -> bool {
        let host = self.authority.rsplit_once(':').map_or("", |(host, _)| host);
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    }

    /// Whether a password may be sent here: over TLS, or in clear to loopback only.
    pub(crate) fn takes_password(&self) -> bool {
        self.scheme == Scheme::Https || self.is_loopback()
    }

    /// The URL as given.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Whether it is spoken to over TLS.
    pub(crate) fn is_https(&self) -> bool {
        self.scheme == Scheme::Https
    }
}

/// Says HTTP/1.1 hello on `io` and runs the connection's I/O on its own task, which ends when
/// the sender and every answer's body are dropped, or when the peer closes.
async fn serve<I>(io: I) -> std::io::Result<SendRequest<Full<Bytes>>>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// An open connection to one endpoint. Requests go one at a time (`&mut self`); a request that
/// fails, times out or is dropped before its answer was read whole leaves the connection
/// unusable ([`Link::is_closed`]), since HTTP/1.1 cannot tell which bytes on it belong to which
/// answer after that.
pub(crate) struct Link {
    endpoint: Endpoint,
    sender: SendRequest<Full<Bytes>>,
    timeout: Duration,
    /// Whether the last exchange ended with its answer read to the end. False from the moment a
    /// request goes out: hyper closes a connection whose request was dropped, but on its own task
    /// and later, so the sender alone would still look usable right after.
    settled: bool,
    /// The token etcd gave this connection's user (etcd with auth on), sent with every request;
    /// each link logs in for its own (a watch's too).
    token: Option<http::HeaderValue>,
}

impl Link {
    /// Connects (TCP, TLS where the endpoint is `https://`, then HTTP/1.1) within `timeout`.
    pub(crate) async fn open(
        endpoint: &Endpoint,
        timeout: Duration,
        tls: Option<&TlsConnector>,
        user: Option<&EtcdUser>,
    ) -> Result<Link, EtcdError> {
        let tls = match endpoint.scheme {
            Scheme::Http => None,
            Scheme::Https => Some((
                tls.ok_or_else(|| EtcdError::NeedsTls(endpoint.url.clone()))?,
                endpoint.server_name()?,
            )),
        };
        let connect = async {
            let stream = TcpStream::connect(&endpoint.authority).await?;
            stream.set_nodelay(true)?;
            Ok::<_, std::io::Error>(match tls {
                None => serve(TokioIo::new(stream)).await?,
                Some((connector, name)) => {
                    let stream = connector.connect(name, stream).await?;
                    serve(TokioIo::new(stream)).await?
                }
            })
        };
        let sender = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| EtcdError::Timeout {
                endpoint: endpoint.url.clone(),
                timeout,
            })?
            .map_err(|e| EtcdError::Http {
                endpoint: endpoint.url.clone(),
                cause: e.to_string(),
            })?;
        let mut link = Link {
            endpoint: endpoint.clone(),
            sender,
            timeout,
            settled: true,
            token: None,
        };
        if let Some(user) = user {
            link.authenticate(user).await?;
        }
        Ok(link)
    }

    /// Logs in as `user`: every later request on this link carries the token etcd gives. Where
    /// etcd's auth is not on (yet), the link goes on without a token, and logs in once a
    /// request is refused for want of one ("user name is empty"): nodes can be given their
    /// users before the operator turns auth on. A login that fails leaves the link closed, so
    /// that the next call connects and logs in again rather than going on without a token.
    pub(crate) async fn authenticate(&mut self, user: &EtcdUser) -> Result<(), EtcdError> {
        if !self.endpoint.takes_password() {
            return Err(EtcdError::PasswordInClear(self.endpoint.url.clone()));
        }
        self.token = None;
        let request = AuthenticateRequest {
            name: user.name(),
            password: user.password(),
        };
        let answer: AuthenticateResponse = match self.call("/v3/auth/authenticate", &request).await
        {
            Ok(answer) => answer,
            Err(EtcdError::Refused { message, .. })
                if message.contains("authentication is not enabled") =>
            {
                return Ok(());
            }
            Err(e) => {
                self.settled = false;
                return Err(e);
            }
        };
        let token = http::HeaderValue::from_str(&answer.token)
            .ok()
            .filter(|_| !answer.token.is_empty())
            .ok_or_else(|| {
                self.settled = false;
                EtcdError::Malformed {
                    endpoint: self.endpoint.url.clone(),
                    detail: "authentication answered no usable token".into(),
                }
            })?;
        self.token = Some(token);
        Ok(())
    }

    pub(crate) fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Whether the connection can carry no more requests.
    pub(crate) fn is_closed(&self) -> bool {
        !self.settled || self.sender.is_closed()
    }

    /// Posts `request` to `path` and reads the whole answer (at most [`MAX_ANSWER`] bytes), all
    /// within the timeout.
    pub(crate) async fn call<T: DeserializeOwned>(
        &mut self,
        path: &str,
        request: &impl Serialize,
    ) -> Result<T, EtcdError> {
        let timeout = self.timeout;
        let exchange = async {
            let answer = self.post(path, request).await?;
            let body = self.read_whole(answer).await?;
            self.parse(&body)
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| self.timed_out())?
    }

    /// Posts `request` to a streaming call, waits (within the timeout) for the answer's head, and
    /// gives its body: the link is the stream's from then on.
    pub(crate) async fn stream(
        mut self,
        path: &str,
        request: &impl Serialize,
    ) -> Result<(Endpoint, Incoming), EtcdError> {
        let answer = tokio::time::timeout(self.timeout, self.post(path, request))
            .await
            .map_err(|_| self.timed_out())??;
        Ok((self.endpoint, answer.into_body()))
    }

    /// A result, or the error that a streamed message carries.
    pub(crate) fn unwrap_item<T>(&self, item: StreamItem<T>) -> Result<Option<T>, EtcdError> {
        match item.error {
            Some(error) => Err(refused(&self.endpoint, &error)),
            None => Ok(item.result),
        }
    }

    /// Sends the request; an answer whose status is not 200 becomes the error etcd gave.
    async fn post(
        &mut self,
        path: &str,
        request: &impl Serialize,
    ) -> Result<hyper::Response<Incoming>, EtcdError> {
        let body = serde_json::to_vec(request).map_err(|e| EtcdError::Malformed {
            endpoint: self.endpoint.url.clone(),
            detail: format!("encoding the request: {e}"),
        })?;
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(path)
            .header(header::HOST, &self.endpoint.authority)
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(token) = &self.token {
            request = request.header(header::AUTHORIZATION, token);
        }
        let request = request
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| self.http_error(e))?;
        self.settled = false;
        self.sender.ready().await.map_err(|e| self.http_error(e))?;
        let answer = self
            .sender
            .send_request(request)
            .await
            .map_err(|e| self.http_error(e))?;
        if answer.status() == StatusCode::OK {
            return Ok(answer);
        }
        let status = answer.status();
        let body = self.read_whole(answer).await?;
        // A call's error is etcd's status itself; a stream that fails before its first message
        // wraps it as `{"error": {...}}`.
        let error = serde_json::from_slice::<StreamItem<serde::de::IgnoredAny>>(&body)
            .ok()
            .and_then(|item| item.error)
            .or_else(|| serde_json::from_slice::<GatewayError>(&body).ok());
        Err(match error {
            Some(error) if error.code != 0 || !error.text().is_empty() => {
                refused(&self.endpoint, &error)
            }
            // etcd's gateway once auth is on, to a client certificate with a common name.
            _ if String::from_utf8_lossy(&body).contains("CommonName of client") => {
                EtcdError::CommonNameRefused(self.endpoint.url.clone())
            }
            // Not quoted where the request carried a password: whatever answered could echo it.
            _ if path.starts_with("/v3/auth/") => EtcdError::Malformed {
                endpoint: self.endpoint.url.clone(),
                detail: format!("HTTP status {status}"),
            },
            _ => EtcdError::Malformed {
                endpoint: self.endpoint.url.clone(),
                detail: format!("HTTP status {status}: {}", excerpt(&body)),
            },
        })
    }

    /// Reads an answer's body to its end (at most [`MAX_ANSWER`] bytes), which settles the
    /// exchange: the connection may carry the next request.
    async fn read_whole(&mut self, answer: hyper::Response<Incoming>) -> Result<Bytes, EtcdError> {
        // A declared length over the bound is refused before a byte of it is read.
        if answer.body().size_hint().lower() > MAX_ANSWER as u64 {
            return Err(self.too_large());
        }
        let body = Limited::new(answer.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| self.body_error(e))?
            .to_bytes();
        self.settled = true;
        Ok(body)
    }

    fn parse<T: DeserializeOwned>(&self, body: &[u8]) -> Result<T, EtcdError> {
        serde_json::from_slice(body).map_err(|e| EtcdError::Malformed {
            endpoint: self.endpoint.url.clone(),
            detail: e.to_string(),
        })
    }

    fn http_error(&self, e: impl std::fmt::Display) -> EtcdError {
        EtcdError::Http {
            endpoint: self.endpoint.url.clone(),
            cause: e.to_string(),
        }
    }

    fn body_error(&self, e: Box<dyn std::error::Error + Send + Sync>) -> EtcdError {
        if e.is::<http_body_util::LengthLimitError>() {
            self.too_large()
        } else {
            self.http_error(e)
        }
    }

    fn too_large(&self) -> EtcdError {
        EtcdError::TooLarge {
            endpoint: self.endpoint.url.clone(),
            limit: MAX_ANSWER,
        }
    }

    fn timed_out(&self) -> EtcdError {
        EtcdError::Timeout {
            endpoint: self.endpoint.url.clone(),
            timeout: self.timeout,
        }
    }
}

/// The start of a body that is not etcd's JSON, printable: what etcd's gateway says in plain
/// text, and never more than a line of whatever else answered.
fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(&body[..body.len().min(160)]);
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect::<String>()
        .trim()
        .to_string()
}

pub(crate) fn refused(endpoint: &Endpoint, error: &GatewayError) -> EtcdError {
    EtcdError::Refused {
        endpoint: endpoint.url.clone(),
        code: error.code,
        message: error.text().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_http_or_https_host_port() {
        assert!(Endpoint::parse("http://127.0.0.1:2379").is_ok());
        assert!(Endpoint::parse("http://etcd-1:2379/").is_ok());
        let tls = Endpoint::parse("https://[::1]:2379").unwrap();
        assert_eq!(tls.scheme, Scheme::Https);
        assert!(
            tls.server_name().is_ok(),
            "an IPv6 address, its brackets off"
        );
        for bad in [
            "127.0.0.1:2379",
            "ftp://h:1",
            "https://h",
            "http://h",
            "http://h:0",
            "http://:1",
            "http://h:1/v3",
            "http://u@h:1",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_password_goes_over_tls_or_to_loopback_only() {
        for takes in [
            "https://10.0.0.2:2379",
            "http://127.0.0.1:2379",
            "http://127.8.0.1:2379",
            "http://[::1]:2379",
            "http://localhost:2379",
        ] {
            assert!(Endpoint::parse(takes).unwrap().takes_password(), "{takes}");
        }
        for clear in [
            "http://10.0.0.2:2379",
            "http://etcd-1:2379",
            "http://localhost.example:2379",
            "http://[::2]:2379",
        ] {
            assert!(!Endpoint::parse(clear).unwrap().takes_password(), "{clear}");
        }
    }
}
